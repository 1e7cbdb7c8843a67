//! Measured wall times by size, and estimates for the sizes not measured (lately).

use std::collections::BTreeMap;

/// Weight of a new observation in the running averages (of sizes; of times that rise).
const EWMA_WEIGHT: f64 = 0.2;
/// Steps after which a measured cost counts as unmeasured again.
pub(super) const STALE_STEPS: u64 = 512;

/// The sizes timed in one bucket and their times, and the step they were last updated at.
#[derive(Debug, Clone, Copy)]
pub(super) struct Measured {
    /// The mean size of the steps timed (a bucket holds several sizes).
    pub size: f64,
    /// A low envelope of the times: a step's time is its own work plus whatever else the
    /// machine did meanwhile (other processes, on a shared machine, take whole milliseconds),
    /// which only ever adds. A faster time is taken at once; a slower one moves it by
    /// EWMA_WEIGHT of the difference, so that one slow step does not make a size look dear,
    /// and a cost that really rose is followed within a few steps.
    pub seconds: f64,
    /// Times measured since the point was (re)started.
    samples: u32,
    pub at_step: u64,
}

/// Wall seconds measured by bucket (of a step's tokens; a drafter's k + 1), and estimates for
/// the sizes in between and beyond.
#[derive(Debug, Clone, Default)]
pub(super) struct CostCurve {
    pub points: BTreeMap<usize, Measured>,
}

impl CostCurve {
    /// A step of `size` (timed under `bucket`) took `seconds`.
    pub fn record(&mut self, bucket: usize, size: usize, seconds: f64, step: u64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let size = size as f64;
        let entry = self.points.entry(bucket).or_insert(Measured { size, seconds, samples: 0, at_step: step });
        if entry.samples > 0 && step.saturating_sub(entry.at_step) < STALE_STEPS {
            entry.size += EWMA_WEIGHT * (size - entry.size);
            entry.seconds = if seconds < entry.seconds { seconds } else { entry.seconds + EWMA_WEIGHT * (seconds - entry.seconds) };
            entry.samples = entry.samples.saturating_add(1);
        } else {
            (entry.size, entry.seconds, entry.samples) = (size, seconds, 1);
        }
        entry.at_step = step;
    }

    /// The cost at `size` (a whole size, or an expected one between two) as of `step`: on the
    /// line between the fresh buckets whose mean sizes lie nearest below and above it (or at
    /// it). Outside the sizes measured lately, the cheapest cost the measured ones allow, so
    /// that an unmeasured size gets tried and measured rather than ruled out on a guess: below
    /// the smallest, in proportion to size (a smaller step costs no less per unit); above the
    /// largest, the largest's cost (a larger step costs no less). `None` when nothing fresh
    /// was measured.
    pub fn estimate(&self, size: f64, step: u64) -> Option<f64> {
        let x = size.max(0.0);
        // Buckets hold disjoint ranges of sizes, so their mean sizes rise with them.
        let fresh: Vec<&Measured> = self.points.values().filter(|m| step.saturating_sub(m.at_step) < STALE_STEPS).collect();
        let below = fresh.iter().rev().find(|m| m.size <= x);
        let above = fresh.iter().find(|m| m.size > x);
        match (below, above) {
            (Some(b), Some(a)) => Some(b.seconds + (a.seconds - b.seconds) * (x - b.size) / (a.size - b.size)),
            (Some(b), None) => Some(b.seconds),
            (None, Some(a)) => Some(a.seconds * x / a.size.max(1.0)),
            (None, None) => None,
        }
    }

    pub fn is_fresh(&self, step: u64) -> bool {
        self.points.values().any(|m| step.saturating_sub(m.at_step) < STALE_STEPS)
    }
}

/// The bucket a step of `tokens` tokens is timed under: each size up to 8 (the verify steps of
/// one or two rows, whose cost on a CPU grows with every token), then steps of a half power of
/// two (12, 16, 24, 32, 48, ...), about as fine as the capture sizes.
pub fn token_bucket(tokens: usize) -> usize {
    if tokens <= 8 {
        return tokens.max(1);
    }
    let p = tokens.next_power_of_two();
    if tokens <= p / 4 * 3 {
        p / 4 * 3
    } else {
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_a_half_power_grid() {
        let b: Vec<usize> = [0, 1, 2, 3, 5, 8, 9, 12, 13, 16, 17, 24, 25, 32, 33, 100, 129].into_iter().map(token_bucket).collect();
        assert_eq!(b, vec![1, 1, 2, 3, 5, 8, 12, 12, 16, 16, 24, 24, 32, 32, 48, 128, 192]);
    }

    #[test]
    fn costs_are_interpolated_and_extrapolated_by_size() {
        let mut c = CostCurve::default();
        assert_eq!(c.estimate(8.0, 0), None);
        c.record(8, 8, 2e-3, 1);
        c.record(32, 32, 5e-3, 1);
        assert_eq!(c.estimate(8.0, 1), Some(2e-3));
        // An expected size between two measured ones: on the line too.
        assert!((c.estimate(12.8, 1).unwrap() - 2.6e-3).abs() < 1e-12);
        // Between two measured sizes: on the line between them.
        assert!((c.estimate(16.0, 1).unwrap() - 3e-3).abs() < 1e-12);
        // Below the smallest: in proportion; above the largest: as the largest (both the
        // cheapest the measured sizes allow, so that they get tried).
        assert!((c.estimate(2.0, 1).unwrap() - 0.5e-3).abs() < 1e-12);
        assert_eq!(c.estimate(64.0, 1), Some(5e-3));
        // Stale points count as unmeasured; a stale point is replaced, not averaged.
        c.record(32, 32, 6e-3, STALE_STEPS + 1);
        assert_eq!(c.estimate(8.0, STALE_STEPS + 1), Some(6e-3 * 8.0 / 32.0));
        c.record(2, 2, 1e-3, STALE_STEPS + 1);
        assert_eq!(c.estimate(8.0, STALE_STEPS + 1), Some(1e-3 + 5e-3 * 6.0 / 30.0));
        c.record(8, 8, 1e-3, STALE_STEPS + 1);
        assert_eq!(c.estimate(8.0, STALE_STEPS + 1), Some(1e-3));
        // Nonsense times are ignored.
        c.record(8, 8, f64::NAN, STALE_STEPS + 1);
        c.record(8, 8, -1.0, STALE_STEPS + 1);
        assert_eq!(c.estimate(8.0, STALE_STEPS + 1), Some(1e-3));
    }

    #[test]
    fn a_bucket_stands_at_the_mean_size_it_timed() {
        // Steps of 144 tokens are timed under the bucket of 192: their cost is the cost at 144,
        // not at 192 (which would put 144 on a line below it).
        let mut c = CostCurve::default();
        c.record(token_bucket(16), 16, 2e-3, 1);
        c.record(token_bucket(144), 144, 16e-3, 1);
        assert_eq!(c.estimate(144.0, 1), Some(16e-3));
        assert!((c.estimate(80.0, 1).unwrap() - 9e-3).abs() < 1e-12);
        // The mean moves with what is timed.
        c.record(token_bucket(160), 160, 16e-3, 2);
        assert!((c.points[&192].size - 147.2).abs() < 1e-9);
    }

    #[test]
    fn a_slow_step_moves_a_cost_a_little_and_a_fast_one_at_once() {
        let mut c = CostCurve::default();
        c.record(4, 4, 1e-3, 1);
        assert_eq!(c.estimate(4.0, 1), Some(1e-3));
        // Another process took the machine for 4 ms during a step.
        c.record(4, 4, 5e-3, 2);
        assert!((c.estimate(4.0, 2).unwrap() - 1.8e-3).abs() < 1e-12);
        c.record(4, 4, 1e-3, 3);
        assert_eq!((c.estimate(4.0, 3), c.points[&4].samples), (Some(1e-3), 3));
        // A first time that was slow is replaced by the next faster one.
        c.record(8, 8, 9e-3, 3);
        assert_eq!(c.estimate(6.0, 3), Some(5e-3));
        c.record(8, 8, 2e-3, 4);
        assert_eq!(c.estimate(8.0, 4), Some(2e-3));
        // A cost that really rose is followed.
        for s in 5..20 {
            c.record(8, 8, 4e-3, s);
        }
        assert!(c.estimate(8.0, 20).unwrap() > 3.9e-3);
    }
}

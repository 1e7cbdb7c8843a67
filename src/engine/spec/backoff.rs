//! Speculation back-off: how many drafts per row the next step verifies, chosen from what
//! verifying costs on this machine and what drafts have been worth lately.
//!
//! A verify row of k drafts emits `1 + q_0 + ... + q_{k-1}` tokens on average, where `q_i` is
//! the chance that drafts 0..=i all exist and are accepted (counted per method over recent
//! rows). It costs the whole step at its token count (forward, draws, commits: everything but
//! the proposal, timed from the step's start) plus, for MTP, the drafter's catch-up and chain
//! of k forwards, timed by the number of MTP rows and k. The choice is the k with the most
//! expected tokens per second, so it follows the machine: on a GPU at one sequence a step of 5
//! tokens costs about what a step of 1 does and k stays at its maximum; at 32 sequences a
//! verify step costs more than its accepted drafts save, and k drops, to 0 where nothing pays.
//!
//! A size not measured yet is estimated from the measured ones ([`CostCurve`]): between two
//! measured sizes, on the line between them; below the smallest, in proportion to size (so it
//! looks cheap and gets tried, and measured); above the largest, as dear per token as the
//! largest (in proportion again), so that drafting is not tried on hope where verifying
//! already costs by the token. A cost measured long ago is
//! dropped, so that conditions that changed are measured again, and while backed off one
//! choice in EXPLORE_EVERY offers every draft, which both measures the largest step and keeps
//! the acceptance estimates current.
//!
//! Drafting never changes a request's tokens (DESIGN Invariant 3): the back-off changes speed,
//! never text.

use super::super::request::SpecMethod;
use std::collections::BTreeMap;

/// Weight of a new observation in the running averages.
const EWMA_WEIGHT: f64 = 0.2;
/// Steps after which a measured cost counts as unmeasured again.
const STALE_STEPS: u64 = 512;
/// How much each acceptance observation decays the older ones (a memory of ~50 rows, so that
/// one full offer to a batch of rows outweighs what was learnt long before).
const ACCEPTANCE_DECAY: f64 = 0.98;
/// While backed off, every this many choices offers all k drafts once: what drafts are worth
/// is only learnt by verifying them (a request's first tokens give an ngram drafter little to
/// match, and an estimate taken then would otherwise stand for the rest of the run).
const EXPLORE_EVERY: u64 = 32;

/// A running average and the step it was last updated at.
#[derive(Debug, Clone, Copy)]
struct Measured {
    seconds: f64,
    at_step: u64,
}

/// Wall seconds measured by size (a step's token bucket, a drafter's k + 1), and estimates
/// for the sizes in between and beyond.
#[derive(Debug, Clone, Default)]
struct CostCurve {
    points: BTreeMap<usize, Measured>,
}

impl CostCurve {
    fn record(&mut self, size: usize, seconds: f64, step: u64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let entry = self.points.entry(size).or_insert(Measured { seconds, at_step: step });
        let fresh = step.saturating_sub(entry.at_step) < STALE_STEPS;
        entry.seconds = if fresh { entry.seconds + EWMA_WEIGHT * (seconds - entry.seconds) } else { seconds };
        entry.at_step = step;
    }

    /// The cost at `size` as of `step`: measured there; else on the line between the nearest
    /// fresh sizes measured below and above; else in proportion to size from the nearest fresh
    /// one (cheaper below the smallest measured, so that it gets tried; as dear per unit as the
    /// largest above it). `None` when nothing fresh was measured.
    fn estimate(&self, size: usize, step: u64) -> Option<f64> {
        let fresh = |m: &&Measured| step.saturating_sub(m.at_step) < STALE_STEPS;
        if let Some(m) = self.points.get(&size).filter(fresh) {
            return Some(m.seconds);
        }
        let below = self.points.range(..size).rev().find(|(_, m)| fresh(m)).map(|(&s, m)| (s as f64, m.seconds));
        let above = self.points.range(size + 1..).find(|(_, m)| fresh(m)).map(|(&s, m)| (s as f64, m.seconds));
        let x = size as f64;
        match (below, above) {
            (Some((x0, c0)), Some((x1, c1))) => Some(c0 + (c1 - c0) * (x - x0) / (x1 - x0)),
            (Some((x0, c0)), None) | (None, Some((x0, c0))) => Some(c0 * x / x0.max(1.0)),
            (None, None) => None,
        }
    }

    fn is_fresh(&self, step: u64) -> bool {
        self.points.values().any(|m| step.saturating_sub(m.at_step) < STALE_STEPS)
    }
}

/// Decayed counts of one method's drafts: per position, rows that could have had draft i (k
/// was above i), rows that had it, rows whose drafts up to i were all accepted.
#[derive(Debug, Clone, Default)]
struct Acceptance {
    offered: Vec<f64>,
    drafted: Vec<f64>,
    accepted: Vec<f64>,
}

impl Acceptance {
    fn record(&mut self, k: usize, drafted: usize, accepted: usize) {
        if self.offered.len() < k {
            self.offered.resize(k, 0.0);
            self.drafted.resize(k, 0.0);
            self.accepted.resize(k, 0.0);
        }
        // Only the positions offered learn (and forget): what a position was worth stays
        // known while the back-off does not offer it.
        for i in 0..k {
            self.offered[i] = self.offered[i] * ACCEPTANCE_DECAY + 1.0;
            self.drafted[i] *= ACCEPTANCE_DECAY;
            self.accepted[i] *= ACCEPTANCE_DECAY;
            self.drafted[i] += f64::from(u8::from(i < drafted));
            self.accepted[i] += f64::from(u8::from(i < accepted));
        }
    }

    /// (chance draft i exists, chance drafts 0..=i are all accepted); unknown positions are
    /// taken as always drafted and accepted, so that they get tried.
    fn position(&self, i: usize) -> (f64, f64) {
        match self.offered.get(i) {
            Some(&n) if n > 0.5 => (self.drafted[i] / n, self.accepted[i] / n),
            _ => (1.0, 1.0),
        }
    }
}

/// The rows of the next step that may speculate, by method.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NextStepRows {
    /// Generate rows that draft nothing (method none).
    pub plain: usize,
    pub ngram: usize,
    pub mtp: usize,
}

/// Chooses k per step; see the module comment.
#[derive(Debug, Clone)]
pub struct SpecBackoff {
    max_k: usize,
    step: u64,
    /// Wall seconds of a generate-only step by token bucket.
    steps: CostCurve,
    /// Wall seconds of an MTP proposal by the bucket of its rows, then by k + 1.
    mtp_drafting: BTreeMap<usize, CostCurve>,
    ngram: Acceptance,
    mtp: Acceptance,
    /// Steps that verified fewer drafts per row than the configured k.
    pub backed_off_steps: u64,
    /// Print the estimates of every 25th choice to stderr (KESTREL_SPEC_BACKOFF_TRACE=1).
    trace: bool,
    /// Choices made (with speculating rows).
    choices: u64,
}

/// The bucket a step of `tokens` tokens is timed under: 1, 2, 4, 8, then steps of a half
/// power of two (12, 16, 24, 32, 48, ...), about as fine as the capture sizes.
pub fn token_bucket(tokens: usize) -> usize {
    if tokens <= 8 {
        return tokens.max(1).next_power_of_two();
    }
    let p = tokens.next_power_of_two();
    if tokens <= p / 4 * 3 {
        p / 4 * 3
    } else {
        p
    }
}

impl SpecBackoff {
    pub fn new(max_k: usize) -> Self {
        let trace = std::env::var("KESTREL_SPEC_BACKOFF_TRACE").is_ok_and(|v| v == "1");
        SpecBackoff { max_k, step: 0, steps: CostCurve::default(), mtp_drafting: BTreeMap::new(), ngram: Acceptance::default(), mtp: Acceptance::default(), backed_off_steps: 0, trace, choices: 0 }
    }

    /// A generate-only step of `tokens` tokens took `seconds` (from its start to its commits).
    pub fn record_step(&mut self, tokens: usize, seconds: f64) {
        self.step += 1;
        self.steps.record(token_bucket(tokens), seconds, self.step);
    }

    /// An MTP proposal for `rows` rows (catch-up and chain) of up to `k` drafts per row took
    /// `seconds`.
    pub fn record_mtp_drafting(&mut self, rows: usize, k: usize, seconds: f64) {
        self.mtp_drafting.entry(token_bucket(rows)).or_default().record(k + 1, seconds, self.step);
    }

    /// A verify row of `method` offered `k` drafts, had `drafted` and accepted `accepted`.
    pub fn record_row(&mut self, method: SpecMethod, k: usize, drafted: usize, accepted: usize) {
        match method {
            SpecMethod::Ngram => self.ngram.record(k, drafted, accepted),
            SpecMethod::Mtp => self.mtp.record(k, drafted, accepted),
            SpecMethod::None => {}
        }
    }

    /// Drafts per row for the next step: the k of 0..=max_k with the most expected tokens per
    /// second (the largest on a tie, so that free drafts are kept).
    pub fn choose(&mut self, rows: NextStepRows) -> usize {
        if rows.ngram + rows.mtp == 0 {
            return self.max_k;
        }
        let mut best = (0, f64::MIN);
        let mut trace = String::new();
        for k in 0..=self.max_k {
            let (tokens, emitted) = self.expected(rows, k);
            let mut seconds = self.steps.estimate(token_bucket(tokens.ceil() as usize), self.step).unwrap_or(0.0);
            if rows.mtp > 0 {
                seconds += self.mtp_drafting_cost(rows.mtp, k);
            }
            let rate = if seconds > 0.0 { emitted / seconds } else { f64::MAX };
            if self.trace {
                trace.push_str(&format!(" k{k}: {tokens:.1} tok {:.3} ms {emitted:.1} out", seconds * 1e3));
            }
            if rate >= best.1 {
                best = (k, rate);
            }
        }
        self.choices += 1;
        if best.0 < self.max_k && self.choices.is_multiple_of(EXPLORE_EVERY) {
            best.0 = self.max_k;
        }
        if best.0 < self.max_k {
            self.backed_off_steps += 1;
        }
        if self.trace && self.choices % 25 == 1 {
            eprintln!("spec back-off choice {} step {} rows {rows:?}:{trace} -> k {}", self.choices, self.step, best.0);
        }
        best.0
    }

    /// (tokens the step forwards, tokens it is expected to emit) with k drafts per row.
    fn expected(&self, rows: NextStepRows, k: usize) -> (f64, f64) {
        let mut tokens = (rows.plain + rows.ngram + rows.mtp) as f64;
        let mut emitted = tokens;
        for (count, acceptance) in [(rows.ngram, &self.ngram), (rows.mtp, &self.mtp)] {
            for i in 0..k {
                let (drafted, accepted) = acceptance.position(i);
                tokens += count as f64 * drafted;
                emitted += count as f64 * accepted;
            }
        }
        (tokens, emitted)
    }

    /// What an MTP proposal of k drafts for `rows` rows costs: measured or estimated at this
    /// row bucket; where none is fresh, the nearest bucket's, in proportion to rows (0 where
    /// nothing was measured). The catch-up alone (k = 0) only from this bucket.
    fn mtp_drafting_cost(&self, rows: usize, k: usize) -> f64 {
        let bucket = token_bucket(rows);
        if k == 0 {
            // The catch-up alone: measured at this row bucket, or taken as free until it is
            // (so that backing off is tried; a catch-up costs far less than a chained draft,
            // which also waits for its argmax, so the costs of drafts say little about it).
            return self.mtp_drafting.get(&bucket).and_then(|c| c.points.get(&1)).filter(|m| self.step.saturating_sub(m.at_step) < STALE_STEPS).map_or(0.0, |m| m.seconds);
        }
        let fresh = |(_, c): &(&usize, &CostCurve)| c.is_fresh(self.step);
        if let Some(cost) = self.mtp_drafting.get(&bucket).and_then(|c| c.estimate(k + 1, self.step)) {
            return cost;
        }
        let below = self.mtp_drafting.range(..bucket).rev().find(fresh);
        let above = self.mtp_drafting.range(bucket + 1..).find(fresh);
        let nearest = match (below, above) {
            (Some(b), Some(a)) => Some(if bucket - b.0 <= a.0 - bucket { b } else { a }),
            (b, a) => b.or(a),
        };
        nearest.and_then(|(&b, c)| c.estimate(k + 1, self.step).map(|s| s * bucket as f64 / b as f64)).unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(ngram: usize) -> NextStepRows {
        NextStepRows { plain: 0, ngram, mtp: 0 }
    }

    /// Accepted drafts of 16 consecutive rows that draft without limit: each draft accepted
    /// with chance 1/2 after the ones before it (8 rows accept none, 4 one, 2 two, ...).
    const GEOMETRIC: [usize; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 16];
    /// Every draft accepted.
    const ALWAYS: [usize; 16] = [16; 16];

    /// Feeds `steps` steps of `seqs` ngram rows at the chosen k, with step costs from
    /// `cost(tokens)` and accepted drafts from `pattern`; returns the k of each step.
    fn run(b: &mut SpecBackoff, seqs: usize, pattern: &[usize; 16], cost: impl Fn(usize) -> f64, steps: usize) -> Vec<usize> {
        let mut chosen = Vec::new();
        for s in 0..steps {
            let k = b.choose(rows(seqs));
            chosen.push(k);
            for r in 0..seqs {
                b.record_row(SpecMethod::Ngram, k, k, pattern[(s * seqs + r) % 16].min(k));
            }
            b.record_step(seqs * (k + 1), cost(seqs * (k + 1)));
        }
        chosen
    }

    /// Whether choice `i` (0-based) is one of the periodic full offers.
    fn explores(i: usize) -> bool {
        (i as u64 + 1).is_multiple_of(EXPLORE_EVERY)
    }

    #[test]
    fn buckets_follow_a_half_power_grid() {
        let b: Vec<usize> = [0, 1, 2, 3, 5, 8, 9, 12, 13, 16, 17, 24, 25, 32, 33, 100, 129].into_iter().map(token_bucket).collect();
        assert_eq!(b, vec![1, 1, 2, 4, 8, 8, 12, 12, 16, 16, 24, 24, 32, 32, 48, 128, 192]);
    }

    #[test]
    fn costs_are_interpolated_and_extrapolated_by_size() {
        let mut c = CostCurve::default();
        assert_eq!(c.estimate(8, 0), None);
        c.record(8, 2e-3, 1);
        c.record(32, 5e-3, 1);
        assert_eq!(c.estimate(8, 1), Some(2e-3));
        // Between two measured sizes: on the line between them.
        assert!((c.estimate(16, 1).unwrap() - 3e-3).abs() < 1e-12);
        // Below the smallest: in proportion (cheaper, so it gets tried).
        assert!((c.estimate(2, 1).unwrap() - 0.5e-3).abs() < 1e-12);
        // Above the largest: as dear per unit as the largest.
        assert!((c.estimate(64, 1).unwrap() - 10e-3).abs() < 1e-12);
        // Stale points count as unmeasured; a stale point is replaced, not averaged.
        c.record(32, 6e-3, STALE_STEPS + 1);
        assert_eq!(c.estimate(8, STALE_STEPS + 1), Some(6e-3 * 8.0 / 32.0));
        c.record(8, 1e-3, STALE_STEPS + 1);
        assert_eq!(c.estimate(8, STALE_STEPS + 1), Some(1e-3));
        // Nonsense times are ignored.
        c.record(8, f64::NAN, STALE_STEPS + 1);
        c.record(8, -1.0, STALE_STEPS + 1);
        assert_eq!(c.estimate(8, STALE_STEPS + 1), Some(1e-3));
    }

    #[test]
    fn free_verification_keeps_every_draft() {
        // Latency-bound: a step costs the same at any token count up to 64.
        let mut b = SpecBackoff::new(4);
        let chosen = run(&mut b, 1, &GEOMETRIC, |_| 1e-3, 50);
        assert!(chosen[10..].iter().all(|&k| k == 4), "{chosen:?}");
        // Only while trying the smaller k.
        assert!(b.backed_off_steps <= 4, "{chosen:?}");
    }

    #[test]
    fn costly_verification_backs_off_to_plain_decoding() {
        // Compute-bound at 32 rows: time proportional to tokens. k drafts emit under 2 tokens
        // per row for k + 1 tokens of work: k = 0 is best.
        let mut b = SpecBackoff::new(4);
        let chosen = run(&mut b, 32, &GEOMETRIC, |t| t as f64 * 1e-5, 60);
        assert!(chosen[..10].contains(&4), "k = 4 was never tried: {chosen:?}");
        // Backed off from the third choice on (a first full offer measures the dear step, a
        // plain one the cheap step), but every EXPLORE_EVERY-th choice offers every draft again.
        for (i, &k) in chosen.iter().enumerate().skip(2) {
            assert_eq!(k, if explores(i) { 4 } else { 0 }, "{chosen:?}");
        }
        assert!(b.backed_off_steps >= 56);
    }

    #[test]
    fn drafting_turns_off_at_many_rows_and_on_at_few() {
        // One machine: a step costs 0.3 ms up to 16 tokens, then 0.04 ms more per token (a
        // small model whose steps are bound by launches at few rows and by work at many).
        let cost = |t: usize| 3e-4 + 4e-5 * t.saturating_sub(16) as f64;
        let mut b = SpecBackoff::new(4);
        // 32 rows, geometric acceptance: a verify step of k = 4 costs 6.1 ms for 62 tokens,
        // a plain one 0.94 ms for 32: drafting off.
        let chosen = run(&mut b, 32, &GEOMETRIC, cost, 40);
        assert!(chosen[4..].iter().enumerate().all(|(i, &k)| k == 0 || explores(i + 4)), "{chosen:?}");
        // The batch drains to 2 rows: 0.3 ms a step whatever k, and 1.88 and 1.94 tokens per
        // row at k = 3 and 4 against 1: drafting on, after one plain step measures the small
        // step (at k = 3 or 4: the sizes between 2 and 32 tokens are estimated on the line
        // between them, which puts k = 3 ahead until a full offer measures k = 4).
        let chosen = run(&mut b, 2, &GEOMETRIC, cost, 20);
        assert!(chosen[1..].iter().all(|&k| k >= 3), "{chosen:?}");
        // Back to 32 rows: off again at once (the large steps are still measured).
        let chosen = run(&mut b, 32, &GEOMETRIC, cost, 10);
        assert!(chosen.iter().enumerate().all(|(i, &k)| k == 0 || explores(i + 60)), "{chosen:?}");
        assert!(b.backed_off_steps >= 40);
    }

    #[test]
    fn a_partly_paying_cost_picks_an_intermediate_k() {
        // A fixed cost per step plus a cost per token. Every draft accepted: k drafts emit k + 1
        // tokens per row, more is always better.
        let mut b = SpecBackoff::new(8);
        let chosen = run(&mut b, 8, &ALWAYS, |t| 1e-3 + t as f64 * 1e-4, 60);
        assert!(chosen[30..].iter().all(|&k| k == 8), "{chosen:?}");
        // Geometric acceptance, 3 units fixed and 1 per token and row: k = 0, 1, 2, 3 give
        // 1/4, 1.5/5, 1.75/6, 1.875/7 tokens per unit: k = 1.
        let mut b = SpecBackoff::new(8);
        let chosen = run(&mut b, 16, &GEOMETRIC, |t| 3e-4 * 16.0 + t as f64 * 1e-4, 80);
        assert!(chosen[60..].iter().enumerate().all(|(i, &k)| k == 1 || explores(i + 60)), "{chosen:?}");
    }

    #[test]
    fn stale_costs_are_measured_again() {
        let mut b = SpecBackoff::new(2);
        run(&mut b, 32, &GEOMETRIC, |t| t as f64 * 1e-5, 40);
        assert_eq!(b.choose(rows(32)), 0);
        assert_eq!(b.choices, 41);
        // Long after, verification became free (fewer tokens to the step, say): the stale
        // large step is measured again at the next full offer, and kept.
        for _ in 0..STALE_STEPS {
            b.record_step(32, 32e-5);
        }
        let chosen = run(&mut b, 32, &GEOMETRIC, |_| 32e-5, 40);
        let offered = chosen.iter().position(|&k| k == 2).expect("the full offer comes back");
        assert!(chosen[offered..].iter().all(|&k| k == 2), "{chosen:?}");
    }

    #[test]
    fn mtp_pays_for_its_chain() {
        // Forwards are free but each chained MTP draft costs as much as a step: drafting k
        // costs k + 1 units for at most 1 + k q tokens, so with q = 0.5 k = 0 wins.
        let mut b = SpecBackoff::new(3);
        let mut chosen = Vec::new();
        for _ in 0..40 {
            let k = b.choose(NextStepRows { plain: 1, ngram: 0, mtp: 1 });
            chosen.push(k);
            b.record_mtp_drafting(1, k, k as f64 * 1e-3);
            b.record_row(SpecMethod::Mtp, k, k, k / 2);
            b.record_step(2 + k, 1e-3);
        }
        assert!(chosen[20..].iter().enumerate().all(|(i, &k)| k == 0 || explores(i + 20)), "{chosen:?}");
    }

    #[test]
    fn mtp_drafting_is_costed_by_its_rows() {
        // A proposal costs 0.1 ms per chained draft for each row (the catch-up next to
        // nothing): cheap at 1 row, dear at 32; a step costs 0.5 ms whatever its size, and
        // every draft is accepted.
        let mut b = SpecBackoff::new(4);
        let feed = |b: &mut SpecBackoff, n: usize, steps: usize| -> Vec<usize> {
            let mut chosen = Vec::new();
            for _ in 0..steps {
                let k = b.choose(NextStepRows { plain: 0, ngram: 0, mtp: n });
                chosen.push(k);
                b.record_mtp_drafting(n, k, n as f64 * k as f64 * 1e-4);
                for _ in 0..n {
                    b.record_row(SpecMethod::Mtp, k, k, k);
                }
                b.record_step(n * (k + 1), 5e-4);
            }
            chosen
        };
        // 1 row: k = 4 emits 5 tokens for 0.9 ms against 1 for 0.5 (after one plain step
        // measures the cheap end).
        let chosen = feed(&mut b, 1, 10);
        assert!(chosen[2..].iter().all(|&k| k == 4), "{chosen:?}");
        // Not measured at 32 rows yet: the 1-row chain in proportion to rows.
        assert!((b.mtp_drafting_cost(32, 4) - 32.0 * 4e-4).abs() < 1e-12);
        // The catch-up alone is not estimated from drafts: free until measured at 32 rows.
        assert_eq!(b.mtp_drafting_cost(32, 0), 0.0);
        // 32 rows: k = 4 emits 160 tokens for 13.3 ms against 32 for 0.5: off, though the
        // chain was cheap at 1 row.
        let chosen = feed(&mut b, 32, 20);
        // (Once measured at k = 0, one choice tries a k whose chain this row count has not
        // measured yet.)
        assert!(chosen[0] == 0 && chosen[2..].iter().all(|&k| k == 0), "{chosen:?}");
    }

    #[test]
    fn a_stale_acceptance_estimate_is_refreshed() {
        // The first rows find nothing to draft (a request's first tokens), so k = 0 wins;
        // later every draft would be accepted. The periodic full offer learns that.
        let mut b = SpecBackoff::new(4);
        let mut chosen = Vec::new();
        for s in 0..200 {
            let k = b.choose(rows(8));
            chosen.push(k);
            // Early rows draft one token (rejected), later ones k (all accepted).
            let (drafted, accepted) = if s < 40 { (k.min(1), 0) } else { (k, k) };
            for _ in 0..8 {
                b.record_row(SpecMethod::Ngram, k, drafted, accepted);
            }
            // A verify step costs 1.6 units however many drafts it carries, a plain one 1.
            let tokens = 8 + 8 * drafted;
            b.record_step(tokens, if tokens > 8 { 1.6e-3 } else { 1e-3 });
        }
        assert!(chosen[2..31].iter().all(|&k| k == 0), "{chosen:?}");
        // The full offer of choice 64 (after the drafts became good) is what turns it round.
        assert!(chosen[40..63].iter().all(|&k| k == 0), "{chosen:?}");
        assert!(chosen[63..].iter().all(|&k| k == 4), "{chosen:?}");
    }

    #[test]
    fn no_speculating_rows_leave_k_alone() {
        let mut b = SpecBackoff::new(4);
        assert_eq!(b.choose(NextStepRows { plain: 5, ngram: 0, mtp: 0 }), 4);
        assert_eq!(b.backed_off_steps, 0);
    }
}

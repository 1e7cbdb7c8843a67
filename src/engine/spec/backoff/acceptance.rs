//! What one method's drafts have been worth lately, by draft position.

/// How much each acceptance observation decays the older ones (a memory of ~50 rows, so that
/// one full offer to a batch of rows outweighs what was learnt long before).
const ACCEPTANCE_DECAY: f64 = 0.98;
/// Every position's counts start from this many rows that are not observed but assumed (a
/// prior): counts that start from nothing let a single rejected row set a position's
/// acceptance to zero, and drafting then stayed off for the rest of a short reply. Four rows
/// are a weight of a few observations: one row moves an estimate by at most a fifth (a first
/// rejection takes draft 1 from 1/2 to 2/5), a few steps at one sequence or one step of a
/// batch outweigh it, and it fades with the ~50-row memory as old rows do.
pub(super) const PRIOR_ROWS: f64 = 4.0;
/// The prior's chance that a draft is accepted after the ones before it were: 1/2, the mean
/// of a chance nothing is known about (a uniform prior). Draft i is then all-accepted with
/// chance 2^-(i+1): the prior expects the geometric fall-off along a draft that is measured
/// for both drafters, at a moderate rate. The prior drafts every position (a draft that may
/// exist is counted in the step's tokens, its cost, until rows say how often it does).
pub(super) const PRIOR_ACCEPT: f64 = 0.5;

/// Decayed counts of one method's drafts: per position, rows that could have had draft i (k
/// was above i), rows that had it, rows whose drafts up to i were all accepted; each starts
/// from the prior's rows.
#[derive(Debug, Clone, Default)]
pub(super) struct Acceptance {
    offered: Vec<f64>,
    drafted: Vec<f64>,
    accepted: Vec<f64>,
}

/// The prior's chance that drafts 0..=i are all accepted.
fn prior_accepted(i: usize) -> f64 {
    PRIOR_ACCEPT.powi(i as i32 + 1)
}

impl Acceptance {
    pub fn record(&mut self, k: usize, drafted: usize, accepted: usize) {
        while self.offered.len() < k {
            let i = self.offered.len();
            self.offered.push(PRIOR_ROWS);
            self.drafted.push(PRIOR_ROWS);
            self.accepted.push(PRIOR_ROWS * prior_accepted(i));
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

    /// (chance draft i exists, chance drafts 0..=i are all accepted); a position never
    /// offered has the prior's.
    pub fn position(&self, i: usize) -> (f64, f64) {
        match self.offered.get(i) {
            Some(&n) => (self.drafted[i] / n, self.accepted[i] / n),
            None => (1.0, prior_accepted(i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_rejected_row_does_not_zero_a_position() {
        let mut a = Acceptance::default();
        assert_eq!(a.position(0), (1.0, 0.5));
        assert_eq!(a.position(2), (1.0, 0.125));
        a.record(4, 4, 0);
        let (drafted, accepted) = a.position(0);
        assert_eq!(drafted, 1.0);
        assert!((accepted - 0.4).abs() < 0.01, "{accepted}");
        // Positions past the rejection keep most of the prior.
        assert!(a.position(3).1 > 0.6 * 0.0625, "{:?}", a.position(3));
        // A run of accepted rows raises it towards one, a run of rejected ones towards zero.
        for _ in 0..20 {
            a.record(4, 4, 4);
        }
        assert!(a.position(0).1 > 0.8 && a.position(3).1 > 0.75, "{:?}", a.position(3));
        for _ in 0..100 {
            a.record(4, 1, 0);
        }
        let (drafted, accepted) = a.position(0);
        assert!(accepted < 0.2 && drafted > 0.8, "{drafted} {accepted}");
        assert!(a.position(1).0 < 0.2, "draft 2 stopped existing: {:?}", a.position(1));
    }

    #[test]
    fn positions_not_offered_keep_what_they_learnt() {
        let mut a = Acceptance::default();
        for _ in 0..10 {
            a.record(3, 3, 3);
        }
        let third = a.position(2);
        for _ in 0..10 {
            a.record(1, 1, 0);
        }
        assert_eq!(a.position(2), third);
        assert!(a.position(0).1 < 0.5);
    }
}

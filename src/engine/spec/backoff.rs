//! Speculation back-off: how many drafts per row the next step verifies, chosen from what
//! verifying costs on this machine and what drafts have been worth lately.
//!
//! A verify row of k drafts emits `1 + q_0 + ... + q_{k-1}` tokens on average, where `q_i` is
//! the chance that drafts 0..=i all exist and are accepted (counted per method over recent
//! rows). It costs the step's forward at its token count plus, for MTP, the drafter's chain of
//! k forwards. Both costs are measured as the engine runs (wall time per generate-only step by
//! token bucket, per MTP proposal by k), so the choice follows the machine: on a GPU at one
//! sequence a step of 5 tokens costs about what a step of 1 does and k stays at its maximum;
//! at 32 sequences a verify step can cost more than its accepted drafts save, and k drops, to
//! 0 where nothing pays. A cost not yet measured is taken as that of the nearest smaller
//! bucket measured (optimistic), so every choice is tried once; a cost measured long ago is
//! treated as unmeasured again, so a choice abandoned under other conditions gets retried, and
//! while backed off one step in EXPLORE_EVERY offers every draft, so acceptance keeps being
//! measured.
//!
//! Drafting never changes a request's tokens (DESIGN Invariant 3): the back-off changes speed,
//! never text.

use super::super::request::SpecMethod;
use std::collections::HashMap;

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
    forward: HashMap<usize, Measured>,
    /// Wall seconds of an MTP proposal by k.
    mtp_drafting: HashMap<usize, Measured>,
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
        SpecBackoff { max_k, step: 0, forward: HashMap::new(), mtp_drafting: HashMap::new(), ngram: Acceptance::default(), mtp: Acceptance::default(), backed_off_steps: 0, trace, choices: 0 }
    }

    /// A generate-only step of `tokens` tokens took `seconds` (forward and draws).
    pub fn record_forward(&mut self, tokens: usize, seconds: f64) {
        self.step += 1;
        update(&mut self.forward, token_bucket(tokens), seconds, self.step);
    }

    /// An MTP proposal of up to `k` drafts per row took `seconds`.
    pub fn record_mtp_drafting(&mut self, k: usize, seconds: f64) {
        update(&mut self.mtp_drafting, k, seconds, self.step);
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
            let mut seconds = self.cost(&self.forward, token_bucket(tokens.ceil() as usize));
            if rows.mtp > 0 {
                seconds += self.cost(&self.mtp_drafting, k);
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
        if self.trace && self.step % 25 == 0 {
            eprintln!("spec back-off step {} rows {rows:?}:{trace} -> k {}", self.step, best.0);
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

    /// The measured cost under `key`, or (unmeasured or stale) that of the nearest smaller
    /// fresh key, or 0.
    fn cost(&self, table: &HashMap<usize, Measured>, key: usize) -> f64 {
        let fresh = |m: &Measured| self.step.saturating_sub(m.at_step) < STALE_STEPS;
        if let Some(m) = table.get(&key).filter(|m| fresh(m)) {
            return m.seconds;
        }
        table.iter().filter(|(&k, m)| k < key && fresh(m)).max_by_key(|(&k, _)| k).map_or(0.0, |(_, m)| m.seconds)
    }
}

fn update(table: &mut HashMap<usize, Measured>, key: usize, seconds: f64, step: u64) {
    if !seconds.is_finite() || seconds < 0.0 {
        return;
    }
    let entry = table.entry(key).or_insert(Measured { seconds, at_step: step });
    let fresh = step.saturating_sub(entry.at_step) < STALE_STEPS;
    entry.seconds = if fresh { entry.seconds + EWMA_WEIGHT * (seconds - entry.seconds) } else { seconds };
    entry.at_step = step;
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
            b.record_forward(seqs * (k + 1), cost(seqs * (k + 1)));
        }
        chosen
    }

    #[test]
    fn buckets_follow_a_half_power_grid() {
        let b: Vec<usize> = [0, 1, 2, 3, 5, 8, 9, 12, 13, 16, 17, 24, 25, 32, 33, 100, 129].into_iter().map(token_bucket).collect();
        assert_eq!(b, vec![1, 1, 2, 4, 8, 8, 12, 12, 16, 16, 24, 24, 32, 32, 48, 128, 192]);
    }

    #[test]
    fn free_verification_keeps_every_draft() {
        // Latency-bound: a step costs the same at any token count up to 64.
        let mut b = SpecBackoff::new(4);
        let chosen = run(&mut b, 1, &GEOMETRIC, |_| 1e-3, 50);
        assert!(chosen[10..].iter().all(|&k| k == 4), "{chosen:?}");
        // Only while trying the smaller k once each.
        assert!(b.backed_off_steps <= 4, "{chosen:?}");
    }

    #[test]
    fn costly_verification_backs_off_to_plain_decoding() {
        // Compute-bound at 32 rows: time proportional to tokens. k drafts emit under 2 tokens
        // per row for k + 1 tokens of work: k = 0 is best.
        let mut b = SpecBackoff::new(4);
        let chosen = run(&mut b, 32, &GEOMETRIC, |t| t as f64 * 1e-5, 60);
        assert!(chosen[..10].contains(&4), "k = 4 was never tried: {chosen:?}");
        // Backed off, but every EXPLORE_EVERY-th choice offers every draft again.
        for (i, &k) in chosen.iter().enumerate().skip(20) {
            assert_eq!(k, if (i as u64 + 1).is_multiple_of(EXPLORE_EVERY) { 4 } else { 0 }, "{chosen:?}");
        }
        assert!(b.backed_off_steps >= 38);
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
        assert!(chosen[60..].iter().enumerate().all(|(i, &k)| k == 1 || (i as u64 + 61).is_multiple_of(EXPLORE_EVERY)), "{chosen:?}");
    }

    #[test]
    fn stale_costs_are_tried_again() {
        let mut b = SpecBackoff::new(2);
        run(&mut b, 32, &GEOMETRIC, |t| t as f64 * 1e-5, 40);
        assert_eq!(b.choose(rows(32)), 0);
        assert_eq!(b.choices, 41);
        // Long after, verification became free (fewer tokens to the step, say): a stale large
        // bucket is retried and kept.
        for _ in 0..STALE_STEPS {
            b.record_forward(32, 32e-5);
        }
        let chosen = run(&mut b, 32, &GEOMETRIC, |_| 32e-5, 20);
        assert!(chosen.iter().skip(5).all(|&k| k == 2), "{chosen:?}");
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
            b.record_mtp_drafting(k, k as f64 * 1e-3);
            b.record_row(SpecMethod::Mtp, k, k, k / 2);
            b.record_forward(2 + k, 1e-3);
        }
        assert!(chosen[20..].iter().enumerate().all(|(i, &k)| k == 0 || (i as u64 + 21).is_multiple_of(EXPLORE_EVERY)), "{chosen:?}");
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
            b.record_forward(tokens, if tokens > 8 { 1.6e-3 } else { 1e-3 });
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

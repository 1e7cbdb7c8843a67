//! Speculation back-off: how many drafts per row the next step verifies, chosen from what
//! verifying costs on this machine and what drafts have been worth lately.
//!
//! A verify row of k drafts emits `1 + q_0 + ... + q_{k-1}` tokens on average, where `q_i` is
//! the chance that drafts 0..=i all exist and are accepted (counted per method over recent
//! rows, from a prior: [`acceptance`]). It costs the whole step at its token count (forward,
//! draws, commits: everything but the proposal, timed from the step's start) plus, for MTP,
//! the drafter's catch-up and chain of k forwards, timed by the number of MTP rows and k. At
//! k = 0 the MTP drafter does not run at all for generate rows (the engine skips their
//! catch-up), so k = 0 costs what a step without speculation does, and both sides of the
//! comparison count all the work they cause. The choice is the k with the most expected
//! tokens per second, so it follows the machine: on a GPU at one sequence a step of 5 tokens
//! costs about what a step of 1 does and k stays at its maximum; at 32 sequences a verify step
//! costs more than its accepted drafts save, and k drops, to 0 where nothing pays.
//!
//! A size not measured yet is estimated from the measured ones ([`costs::CostCurve`]): between
//! two measured sizes, on the line between them; outside them, as cheap as the measured ones
//! allow (below the smallest in proportion to size, above the largest at the largest's cost),
//! so that a choice is never ruled out before its step was measured: it looks cheap, gets
//! made, and is measured. Trying it costs only the drafts that exist (a step is timed by the
//! tokens it had). A cost measured long ago is dropped, so that conditions that changed are
//! measured again. On a shared machine another process can hold a core for whole
//! milliseconds of a step, so a size's cost is a low envelope of its times (a faster time is
//! taken at once, a slower one moves it a little), and the full offer (and the plain step, once
//! made) is made twice to about as many rows before what it measured can rule it out.
//!
//! While backed off, the full offer comes back on a budget: each backed-off choice puts
//! [`EXPLORE_SHARE`] of its estimated time aside, and the full offer is made once what was put
//! aside covers what the estimates say it loses (its time less what its expected tokens are
//! worth at the best rate). What drafts are worth is only learnt by verifying them (a
//! request's first tokens give an ngram drafter little to match), so this bounds the cost of
//! learning to a share of the time: where a full offer costs little more than the best choice
//! it comes back within a few steps, early in a short reply; where it is dear (many rows on a
//! GPU) it comes rarely.
//!
//! Drafting never changes a request's tokens (DESIGN Invariant 3): the back-off changes speed,
//! never text.

mod acceptance;
mod costs;

use super::super::request::SpecMethod;
use acceptance::Acceptance;
pub use costs::token_bucket;
use costs::{CostCurve, STALE_STEPS};
use std::collections::BTreeMap;

/// The share of the estimated time that backed-off choices set aside for full offers: at most
/// about 1/16 (6%) of the time is spent on offers the estimates say lose, which is what being
/// wrong about drafts that became worth it (or about a cost measured on a busy machine) can
/// cost at most before it is found out.
pub const EXPLORE_SHARE: f64 = 1.0 / 16.0;

/// The rows of the next step that may speculate, by method.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NextStepRows {
    /// Generate rows that draft nothing (method none).
    pub plain: usize,
    pub ngram: usize,
    pub mtp: usize,
}

/// What the estimates say of a step with k drafts per row.
#[derive(Debug, Clone, Copy)]
struct Estimate {
    /// Tokens the step forwards.
    tokens: f64,
    /// Tokens it is expected to emit.
    emitted: f64,
    seconds: f64,
}

impl Estimate {
    fn rate(&self) -> f64 {
        if self.seconds > 0.0 {
            self.emitted / self.seconds
        } else {
            f64::MAX
        }
    }
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
    /// Seconds set aside for the next full offer while backed off ([`EXPLORE_SHARE`]).
    explore_budget: f64,
    /// Full offers made lately, and the step of the last, by the bucket of the rows offered.
    full_offers: BTreeMap<usize, (u32, u64)>,
    /// The same of steps offered no drafts.
    plain_offers: BTreeMap<usize, (u32, u64)>,
    /// Steps that verified fewer drafts per row than the configured k.
    pub backed_off_steps: u64,
    /// Print the estimates of every 25th choice to stderr (KESTREL_SPEC_BACKOFF_TRACE=1).
    trace: bool,
    /// Choices made (with speculating rows).
    choices: u64,
}

impl SpecBackoff {
    pub fn new(max_k: usize) -> Self {
        let trace = std::env::var("KESTREL_SPEC_BACKOFF_TRACE").is_ok_and(|v| v == "1");
        SpecBackoff {
            max_k,
            step: 0,
            steps: CostCurve::default(),
            mtp_drafting: BTreeMap::new(),
            ngram: Acceptance::default(),
            mtp: Acceptance::default(),
            explore_budget: 0.0,
            full_offers: BTreeMap::new(),
            plain_offers: BTreeMap::new(),
            backed_off_steps: 0,
            trace,
            choices: 0,
        }
    }

    /// A generate-only step of `tokens` tokens took `seconds` (from its start to its commits).
    pub fn record_step(&mut self, tokens: usize, seconds: f64) {
        self.step += 1;
        self.steps.record(token_bucket(tokens), tokens, seconds, self.step);
    }

    /// An MTP proposal for `rows` rows (catch-up and chain) of `k` >= 1 drafts per row took
    /// `seconds`. (At k = 0 only prompt pieces are caught up: their cost is the prefill's.)
    pub fn record_mtp_drafting(&mut self, rows: usize, k: usize, seconds: f64) {
        if k > 0 {
            self.mtp_drafting.entry(token_bucket(rows)).or_default().record(k + 1, k + 1, seconds, self.step);
        }
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
    /// second (the largest on a tie, so that free drafts are kept), or the full offer where
    /// the exploration budget covers it.
    pub fn choose(&mut self, rows: NextStepRows) -> usize {
        if rows.ngram + rows.mtp == 0 {
            return self.max_k;
        }
        let estimates: Vec<Estimate> = (0..=self.max_k).map(|k| self.estimate(rows, k)).collect();
        let mut best = 0;
        for (k, e) in estimates.iter().enumerate() {
            if e.rate() >= estimates[best].rate() {
                best = k;
            }
        }
        self.choices += 1;
        let full = estimates[self.max_k];
        // One slow step (another process on the machine) must not rule a choice out: the full
        // offer, and the plain step once measured, are measured twice before they can be.
        let why = if best != self.max_k && offers_lately(&self.full_offers, rows, self.step) < 2 {
            self.explore_budget = 0.0;
            best = self.max_k;
            " (measuring)"
        } else if best != 0 && offers_lately(&self.plain_offers, rows, self.step) == 1 {
            best = 0;
            " (measuring)"
        } else if best == self.max_k {
            self.explore_budget = 0.0;
            ""
        } else {
            self.explore_budget += EXPLORE_SHARE * estimates[best].seconds;
            let loss = full.seconds - full.emitted / estimates[best].rate();
            if self.explore_budget >= loss {
                self.explore_budget = 0.0;
                best = self.max_k;
                " (exploring)"
            } else {
                ""
            }
        };
        if best < self.max_k {
            self.backed_off_steps += 1;
        }
        if best == self.max_k {
            note_offer(&mut self.full_offers, rows, self.step);
        } else if best == 0 {
            note_offer(&mut self.plain_offers, rows, self.step);
        }
        if self.trace && self.choices % 25 == 1 {
            let each: String = estimates.iter().enumerate().map(|(k, e)| format!(" k{k}: {:.1} tok {:.3} ms {:.1} out", e.tokens, e.seconds * 1e3, e.emitted)).collect();
            eprintln!("spec back-off choice {} step {} rows {rows:?}:{each} -> k {best}{why}", self.choices, self.step);
        }
        best
    }

    /// The tokens, expected output and cost of a step with k drafts per row.
    fn estimate(&self, rows: NextStepRows, k: usize) -> Estimate {
        let mut tokens = (rows.plain + rows.ngram + rows.mtp) as f64;
        let mut emitted = tokens;
        for (count, acceptance) in [(rows.ngram, &self.ngram), (rows.mtp, &self.mtp)] {
            for i in 0..k {
                let (drafted, accepted) = acceptance.position(i);
                tokens += count as f64 * drafted;
                emitted += count as f64 * accepted;
            }
        }
        // At the expected size itself: a step's tokens vary around it, and their costs with them.
        let mut seconds = self.steps.estimate(tokens, self.step).unwrap_or(0.0);
        if rows.mtp > 0 {
            seconds += self.mtp_drafting_cost(rows.mtp, k);
        }
        Estimate { tokens, emitted, seconds }
    }

    /// What an MTP proposal of k drafts for `rows` rows costs: measured or estimated at this
    /// row bucket; where none is fresh, from the nearest bucket, as cheap as it allows (as
    /// many rows' cost from fewer rows, in proportion to rows from more; 0 where nothing was
    /// measured), so that it gets tried and measured. Nothing at k = 0: the drafter does not
    /// run for generate rows.
    fn mtp_drafting_cost(&self, rows: usize, k: usize) -> f64 {
        if k == 0 {
            return 0.0;
        }
        let bucket = token_bucket(rows);
        let fresh = |(_, c): &(&usize, &CostCurve)| c.is_fresh(self.step);
        if let Some(cost) = self.mtp_drafting.get(&bucket).and_then(|c| c.estimate((k + 1) as f64, self.step)) {
            return cost;
        }
        let below = self.mtp_drafting.range(..bucket).rev().find(fresh);
        let above = self.mtp_drafting.range(bucket + 1..).find(fresh);
        let nearest = match (below, above) {
            (Some(b), Some(a)) => Some(if bucket - b.0 <= a.0 - bucket { b } else { a }),
            (b, a) => b.or(a),
        };
        nearest.and_then(|(&b, c)| c.estimate((k + 1) as f64, self.step).map(|s| if b < bucket { s } else { s * bucket as f64 / b as f64 })).unwrap_or(0.0)
    }
}

/// Offers in `offers` made lately (before `step` by less than STALE_STEPS) to about as many
/// rows as `rows`.
fn offers_lately(offers: &BTreeMap<usize, (u32, u64)>, rows: NextStepRows, step: u64) -> u32 {
    match offers.get(&token_bucket(rows.plain + rows.ngram + rows.mtp)) {
        Some(&(count, at)) if step.saturating_sub(at) < STALE_STEPS => count,
        _ => 0,
    }
}

fn note_offer(offers: &mut BTreeMap<usize, (u32, u64)>, rows: NextStepRows, step: u64) {
    let offer = offers.entry(token_bucket(rows.plain + rows.ngram + rows.mtp)).or_insert((0, step));
    *offer = if step.saturating_sub(offer.1) < STALE_STEPS { (offer.0.saturating_add(1), step) } else { (1, step) };
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

    /// How many of `chosen` are `k`.
    fn count(chosen: &[usize], k: usize) -> usize {
        chosen.iter().filter(|&&c| c == k).count()
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
    fn the_first_offers_are_full_and_measure_the_largest_step_twice() {
        // Nothing measured: the full offer. Only the plain step measured (a request without
        // drafts ran first): still the full offer, whose cost is not guessed but measured.
        let mut b = SpecBackoff::new(4);
        assert_eq!(b.choose(rows(1)), 4);
        let mut b = SpecBackoff::new(4);
        b.record_step(1, 1e-3);
        b.record_step(1, 1e-3);
        assert_eq!(b.choose(rows(1)), 4);
        b.record_row(SpecMethod::Ngram, 4, 4, 0);
        b.record_step(5, 3e-3);
        // Measured once, dear, and its drafts rejected: measured again before it rules
        // drafting out (the step may have shared the machine).
        assert_eq!(b.choose(rows(1)), 4);
        b.record_row(SpecMethod::Ngram, 4, 4, 0);
        b.record_step(5, 3e-3);
        assert!(b.choose(rows(1)) < 4);
    }

    #[test]
    fn one_rejected_offer_does_not_turn_drafting_off() {
        // A CPU at one sequence: a step of 2 tokens costs 1.2 units, of 5 tokens 1.6, of 1
        // token 1. The first full offer is rejected outright; the prior still says drafts pay
        // (1.5 tokens for 1.2 units at k = 1 against 1 for 1), so drafting goes on.
        let cost = |t: usize| if t == 1 { 1e-3 } else { 1e-3 + 0.15e-3 * t as f64 };
        let mut b = SpecBackoff::new(4);
        b.record_step(1, cost(1));
        assert_eq!(b.choose(rows(1)), 4);
        b.record_row(SpecMethod::Ngram, 4, 4, 0);
        b.record_step(5, cost(5));
        let k = b.choose(rows(1));
        assert!(k > 0, "one rejected offer turned drafting off");
        // Rejected again and again: the evidence outweighs the prior, and drafting stops but
        // for the full offers the budget pays for (each loses about 0.7 units: one in ~11).
        let mut chosen = Vec::new();
        for _ in 0..60 {
            let k = b.choose(rows(1));
            chosen.push(k);
            b.record_row(SpecMethod::Ngram, k, k, 0);
            b.record_step(1 + k, cost(1 + k));
        }
        let last = &chosen[30..];
        assert!(count(last, 0) >= 25 && count(last, 0) + count(last, 4) == 30, "{chosen:?}");
    }

    #[test]
    fn a_slow_step_on_a_busy_machine_does_not_turn_drafting_off() {
        // One sequence, every draft accepted, a 5-token step costs 1.5 units against 1; now and
        // then another process holds the machine during a step (10 units more), the first
        // full offer's step among them.
        let mut b = SpecBackoff::new(4);
        let mut chosen = Vec::new();
        for s in 0..100 {
            let k = b.choose(rows(1));
            chosen.push(k);
            b.record_row(SpecMethod::Ngram, k, k, k);
            let busy = if s == 0 || s % 17 == 5 { 10e-3 } else { 0.0 };
            b.record_step(1 + k, busy + if k == 0 { 1e-3 } else { 1.5e-3 });
        }
        // Early on, with few rows to outweigh the prior's 1/2, a slow step can tip the choice
        // to a shorter draft for a few steps; later ones cannot.
        assert!(count(&chosen, 4) >= 90, "{chosen:?}");
        assert_eq!(count(&chosen[20..], 4), 80, "{chosen:?}");
    }

    #[test]
    fn a_slow_plain_step_does_not_make_drafting_look_worth_it() {
        // MTP on a CPU: a proposal costs 2 units, a step 1, and one draft in two is accepted:
        // k = 0 is best. The first plain step shared the machine (10 units).
        let mut b = SpecBackoff::new(2);
        let first = std::cell::Cell::new(true);
        let step = |t: usize| {
            let busy = if t == 1 && first.get() { 9e-3 } else { 0.0 };
            first.set(first.get() && t != 1);
            busy + 1e-3
        };
        let chosen = run_mtp(&mut b, 1, 0, |_, _| 2e-3, step, |k| k.min(1), 60);
        assert!(count(&chosen[10..], 0) >= 45, "{chosen:?}");
    }

    #[test]
    fn costly_verification_backs_off_to_plain_decoding() {
        // Compute-bound at 32 rows: time proportional to tokens. k drafts emit under 2 tokens
        // per row for k + 1 tokens of work: k = 0 is best.
        let mut b = SpecBackoff::new(4);
        let chosen = run(&mut b, 32, &GEOMETRIC, |t| t as f64 * 1e-5, 400);
        assert_eq!(chosen[0], 4, "the full offer is measured first");
        // The full offer costs 1.6 units for 62 tokens, a plain step 0.32 for 32: each full
        // offer loses 0.98 units, so one in about 0.98 / (0.32 / 16) = 49 choices comes back.
        let full = count(&chosen[2..], 4);
        assert!((5..=12).contains(&full), "{full} full offers in 400 steps: {chosen:?}");
        assert_eq!(count(&chosen[2..], 0) + full, 398, "{chosen:?}");
        assert!(b.backed_off_steps >= 380);
    }

    #[test]
    fn drafting_turns_off_at_many_rows_and_on_at_few() {
        // One machine: a step costs 0.3 ms up to 16 tokens, then 0.04 ms more per token (a
        // small model whose steps are bound by launches at few rows and by work at many).
        let cost = |t: usize| 3e-4 + 4e-5 * t.saturating_sub(16) as f64;
        let mut b = SpecBackoff::new(4);
        // 32 rows, geometric acceptance: a verify step of k = 4 costs 6.1 ms for 62 tokens,
        // a plain one 0.94 ms for 32: drafting off but for rare full offers.
        let chosen = run(&mut b, 32, &GEOMETRIC, cost, 100);
        assert!(count(&chosen[4..], 0) >= 92, "{chosen:?}");
        // The batch drains to 2 rows: 0.3 ms a step whatever k, and 1.88 and 1.94 tokens per
        // row at k = 3 and 4 against 1: drafting on after two full offers to 2 rows and two
        // plain steps that measure the small step.
        let chosen = run(&mut b, 2, &GEOMETRIC, cost, 20);
        assert!(chosen[4..].iter().all(|&k| k == 4), "{chosen:?}");
        // Back to 32 rows: off again at once (the large steps are still measured).
        let chosen = run(&mut b, 32, &GEOMETRIC, cost, 10);
        assert_eq!(chosen, [0; 10]);
    }

    #[test]
    fn a_partly_paying_cost_picks_an_intermediate_k() {
        // A fixed cost per step plus a cost per token. Every draft accepted: k drafts emit k + 1
        // tokens per row, more is always better.
        let mut b = SpecBackoff::new(8);
        let chosen = run(&mut b, 8, &ALWAYS, |t| 1e-3 + t as f64 * 1e-4, 60);
        assert!(chosen[30..].iter().all(|&k| k == 8), "{chosen:?}");
        // Geometric acceptance, 3 units fixed and 1 per token and row: k = 0, 1, 2, 3 give
        // 1/4, 1.5/5, 1.75/6, 1.875/7 tokens per unit: k = 1, but for rare full offers.
        let mut b = SpecBackoff::new(8);
        let chosen = run(&mut b, 16, &GEOMETRIC, |t| 3e-4 * 16.0 + t as f64 * 1e-4, 200);
        assert!(count(&chosen[60..], 1) >= 130, "{chosen:?}");
        assert!(chosen[60..].iter().all(|&k| k == 1 || k == 8), "{chosen:?}");
    }

    #[test]
    fn stale_costs_are_measured_again() {
        let mut b = SpecBackoff::new(2);
        run(&mut b, 32, &GEOMETRIC, |t| t as f64 * 1e-5, 40);
        assert_eq!(b.choose(rows(32)), 0);
        // Long after, verification became free (fewer tokens to the step, say): the large
        // step's cost is stale, so the full offer measures it again, and is kept.
        for _ in 0..STALE_STEPS {
            b.record_step(32, 32e-5);
        }
        let chosen = run(&mut b, 32, &GEOMETRIC, |_| 32e-5, 40);
        assert!(chosen.iter().all(|&k| k == 2), "{chosen:?}");
    }

    /// Feeds `steps` steps of `n` MTP rows (and `plain` rows without drafts): a proposal of
    /// k >= 1 costs `proposal(n, k)`, a step `step(tokens)`; draft i is accepted when
    /// `accept(i)`. Returns the k of each step.
    fn run_mtp(b: &mut SpecBackoff, n: usize, plain: usize, proposal: impl Fn(usize, usize) -> f64, step: impl Fn(usize) -> f64, accept: impl Fn(usize) -> usize, steps: usize) -> Vec<usize> {
        let mut chosen = Vec::new();
        for _ in 0..steps {
            let k = b.choose(NextStepRows { plain, ngram: 0, mtp: n });
            chosen.push(k);
            // At k = 0 the engine runs no proposal for generate rows.
            if k > 0 {
                b.record_mtp_drafting(n, k, proposal(n, k));
            }
            for _ in 0..n {
                b.record_row(SpecMethod::Mtp, k, k, accept(k));
            }
            b.record_step(plain + n * (k + 1), step(plain + n * (k + 1)));
        }
        chosen
    }

    #[test]
    fn mtp_pays_for_its_chain() {
        // Forwards are free but each MTP draft costs as much as a step: drafting k costs k + 1
        // units for at most 1 + k q tokens, so with q = 0.5 k = 0 wins.
        let mut b = SpecBackoff::new(3);
        let chosen = run_mtp(&mut b, 1, 1, |_, k| k as f64 * 1e-3, |_| 1e-3, |k| k / 2, 100);
        assert!(count(&chosen[20..], 0) >= 70, "{chosen:?}");
    }

    #[test]
    fn mtp_at_k_0_costs_a_plain_step_and_its_catch_up_counts_with_its_drafts() {
        // The catch-up is skipped where no drafts are offered, so k = 0 costs the step alone;
        // a proposal's time (catch-up and chain) is what k >= 1 adds.
        let mut b = SpecBackoff::new(3);
        b.record_step(32, 1e-3);
        b.record_mtp_drafting(32, 0, 5e-3);
        assert_eq!(b.mtp_drafting_cost(32, 0), 0.0);
        assert!(b.mtp_drafting.is_empty(), "a catch-up of prompt pieces is not a proposal's cost");
        let e = b.estimate(NextStepRows { plain: 0, ngram: 0, mtp: 32 }, 0);
        assert_eq!((e.tokens, e.emitted, e.seconds), (32.0, 32.0, 1e-3));
        b.record_mtp_drafting(32, 3, 0.4e-3);
        b.record_step(128, 1.2e-3);
        let e = b.estimate(NextStepRows { plain: 0, ngram: 0, mtp: 32 }, 3);
        assert!((e.seconds - 1.6e-3).abs() < 1e-12, "{e:?}");
        // A catch-up as dear as a step (the GPU at 32 rows): the chain's drafts pay for their
        // verify step, not for it too: k = 0 is chosen once the full offer was measured.
        let mut b = SpecBackoff::new(3);
        // A proposal of 3 drafts to 32 rows costs 0.61 ms, a verify step of 128 tokens 0.43,
        // and one draft in a row is accepted: 64 tokens for 1.04 ms against 32 for 0.33 ms
        // without the drafter. (Were the catch-up charged to k = 0, 0.65 ms for 32 tokens, k = 3
        // would look ahead.)
        let chosen = run_mtp(&mut b, 32, 0, |n, k| n as f64 * (1.0 + 0.3 * k as f64) * 1e-5, |t| 3e-4 + 1e-6 * t as f64, |k| k.min(1), 200);
        assert!(count(&chosen[2..], 0) >= 175, "{chosen:?}");
    }

    #[test]
    fn mtp_drafting_is_costed_by_its_rows() {
        // A proposal costs 0.1 ms per draft for each row: cheap at 1 row, dear at 32; a step
        // costs 0.5 ms whatever its size, and every draft is accepted.
        let proposal = |n: usize, k: usize| n as f64 * k as f64 * 1e-4;
        let mut b = SpecBackoff::new(4);
        // 1 row: k = 4 emits 5 tokens for 0.9 ms against 1 for 0.5 (after two plain steps
        // measure the small step).
        let chosen = run_mtp(&mut b, 1, 0, proposal, |_| 5e-4, |k| k, 10);
        assert!(chosen[4..].iter().all(|&k| k == 4), "{chosen:?}");
        // Not measured at 32 rows yet: the least it can cost, the 1-row chain's (and from 32
        // rows, 4 rows cost an eighth).
        assert!((b.mtp_drafting_cost(32, 4) - 4e-4).abs() < 1e-12);
        // 32 rows: k = 4 emits 160 tokens for 13.3 ms against 32 for 0.5: off, once two full
        // offers measured the 32-row proposal, though the chain was cheap at 1 row.
        let chosen = run_mtp(&mut b, 32, 0, proposal, |_| 5e-4, |k| k, 20);
        assert_eq!(chosen[..2], [4, 4], "{chosen:?}");
        assert!(chosen[2..].iter().all(|&k| k == 0), "{chosen:?}");
        // 4 rows, between the measured 1 and 32: from the nearest (1 row), as much as it.
        assert!((b.mtp_drafting_cost(4, 4) - 4e-4).abs() < 1e-12);
        b.mtp_drafting.remove(&1);
        assert!((b.mtp_drafting_cost(4, 4) - 32.0 * 4e-4 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn the_full_offer_comes_back_early_when_it_costs_little() {
        // One sequence on a CPU: a verify step of 5 tokens costs 1.3 units against 1. The
        // first rows find nothing to accept (a request's first tokens), so drafting stops;
        // then every draft would be accepted. A full offer loses at most 0.3 units by the
        // estimates, which the budget covers within 0.3 / (1 / 16) ~ 5 choices: it comes back
        // within a few steps of a short reply, and drafting stays on from then.
        let cost = |t: usize| if t == 1 { 1e-3 } else { 1.3e-3 };
        let mut b = SpecBackoff::new(4);
        let mut chosen = Vec::new();
        for s in 0..60 {
            let k = b.choose(rows(1));
            chosen.push(k);
            let accepted = if s < 20 { 0 } else { k };
            b.record_row(SpecMethod::Ngram, k, k, accepted);
            b.record_step(1 + k, cost(1 + k));
        }
        assert!(count(&chosen[..20], 4) >= 4, "full offers while backed off: {chosen:?}");
        let back = chosen[20..].iter().position(|&k| k == 4).expect("the full offer comes back");
        assert!(back <= 8, "{chosen:?}");
        assert!(chosen[20 + back + 3..].iter().all(|&k| k == 4), "{chosen:?}");
    }

    #[test]
    fn a_stale_acceptance_estimate_is_refreshed() {
        // Eight rows: the first rows find nothing to draft (a request's first tokens), so
        // k = 0 wins; later every draft would be accepted. By the estimates a full offer
        // loses under 1.5 units (16 to 24 tokens, 1.6 to 2.4 units, for 8 tokens out) against
        // a budget of 1/16 unit per plain step: within ~24 choices one comes back and learns
        // it.
        let mut b = SpecBackoff::new(4);
        let mut chosen = Vec::new();
        for s in 0..100 {
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
        assert!(count(&chosen[5..40], 0) >= 30, "{chosen:?}");
        let back = chosen[40..].iter().position(|&k| k == 4).expect("the full offer comes back");
        assert!(back <= 24, "{chosen:?}");
        assert!(chosen[40 + back + 1..].iter().all(|&k| k == 4), "{chosen:?}");
    }

    #[test]
    fn no_speculating_rows_leave_k_alone() {
        let mut b = SpecBackoff::new(4);
        assert_eq!(b.choose(NextStepRows { plain: 5, ngram: 0, mtp: 0 }), 4);
        assert_eq!(b.backed_off_steps, 0);
    }
}

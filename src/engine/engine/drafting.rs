//! The engine's drafting phase: after a step's tokens are committed, each running sequence's
//! drafts for the next step (ngram from its own text, MTP from the checkpoint's head, or a
//! caller's drafter), as many per row as the back-off offers.

use crate::engine::request::{RequestId, SeqStatus, SpecMethod};
use crate::engine::spec::backoff::NextStepRows;
use crate::engine::spec::mtp::{propose_mtp, MtpCatchUp};
use crate::engine::spec::ngram::{propose_ngram, NgramConfig};
use super::Engine;
use crate::backend::Backend;
use std::time::Instant;

impl<B: Backend> Engine<B> {
    /// Drafts for each running sequence's next step.
    pub(super) fn propose(&mut self, step_hidden: &B::Tensor, mut mtp_items: Vec<(RequestId, MtpCatchUp, bool)>) {
        let k = self.drafts_to_offer();
        self.offered_drafts = k;
        if k == 0 {
            // No drafts offered: the drafter's catch-up on generated tokens is skipped, so that
            // a backed-off step costs what a step without speculation does (on a small model
            // the catch-up forward costs most of a step). Those positions keep whatever the
            // drafter's KV held there: drafts made after it may be worse (the back-off counts
            // what they are worth), never the text, which verification decides. Prompt pieces
            // are still caught up: the prefix cache shares their drafter KV with later requests.
            mtp_items.retain(|(_, _, prompt_piece)| *prompt_piece);
        }
        let max_len = self.config.max_model_len;
        for seq in self.seqs.iter_mut() {
            seq.drafts.clear();
            if seq.status != SeqStatus::Running || seq.in_prefill() {
                continue;
            }
            let left = seq.max_useful_drafts(max_len);
            if let Some(drafter) = self.custom_drafter.as_mut() {
                if seq.method != SpecMethod::None {
                    seq.drafts = drafter(seq.id, &seq.tokens, left);
                    seq.drafts.truncate(left);
                }
                continue;
            }
            if seq.method == SpecMethod::Ngram && k > 0 {
                let cfg = NgramConfig { min_n: self.config.ngram_min, max_n: self.config.ngram_max, k };
                seq.drafts = propose_ngram(&seq.tokens, &cfg, left);
            } else if seq.method == SpecMethod::Ngram && self.backoff.is_some() {
                // Backed off: the drafts not offered are checked against the tokens that come.
                let cfg = NgramConfig { min_n: self.config.ngram_min, max_n: self.config.ngram_max, k: self.config.spec_tokens };
                self.shadow.hold(seq.id, seq.tokens.len(), propose_ngram(&seq.tokens, &cfg, left));
            }
        }
        if mtp_items.is_empty() || self.custom_drafter.is_some() {
            self.keep_valid_drafts();
            return;
        }
        // MTP chains write KV up to k positions past the committed length: make sure blocks exist.
        for (id, item, _) in mtp_items.iter_mut() {
            let Some(seq) = self.seqs.iter_mut().find(|s| s.id == *id) else { continue };
            let left = seq.max_useful_drafts(max_len);
            item.drafts_wanted = item.drafts_wanted.min(left).min(k);
            if item.drafts_wanted > 0 {
                let mut table = std::mem::take(&mut seq.block_table);
                if self.scheduler.blocks.ensure(&mut table, seq.num_computed + 1 + item.drafts_wanted).is_err() {
                    let covered = table.len() * self.scheduler.blocks.block_size();
                    item.drafts_wanted = item.drafts_wanted.min(covered.saturating_sub(seq.num_computed + 1));
                }
                seq.block_table = table;
                item.block_table = seq.block_table.clone();
            }
        }
        let items: Vec<MtpCatchUp> = mtp_items.iter().map(|(_, it, _)| it.clone()).collect();
        let started = Instant::now();
        let drafts = propose_mtp(&self.model, &self.backend, &mut self.cache, step_hidden, &items, self.graphs.as_ref());
        if let Some(backoff) = self.backoff.as_mut() {
            backoff.record_mtp_drafting(items.len(), k, started.elapsed().as_secs_f64());
        }
        for ((id, _, _), d) in mtp_items.iter().zip(drafts) {
            if let Some(seq) = self.seqs.iter_mut().find(|s| s.id == *id) {
                seq.drafts = d;
            }
        }
        self.keep_valid_drafts();
    }

    /// Drafts per row to offer the next step: `spec_tokens`, or with the back-off on what it
    /// chooses for the running rows (a custom drafter is always offered `spec_tokens`).
    fn drafts_to_offer(&mut self) -> usize {
        let Some(backoff) = self.backoff.as_mut().filter(|_| self.custom_drafter.is_none()) else { return self.config.spec_tokens };
        let mut rows = NextStepRows::default();
        for seq in self.seqs.iter().filter(|s| s.status == SeqStatus::Running && !s.in_prefill()) {
            match seq.method {
                SpecMethod::None => rows.plain += 1,
                SpecMethod::Ngram => rows.ngram += 1,
                SpecMethod::Mtp => rows.mtp += 1,
            }
        }
        let k = backoff.choose(rows);
        self.stats.backed_off_steps = backoff.backed_off_steps;
        k
    }

    /// Cuts each grammar-constrained request's drafts where its grammar stops allowing them:
    /// such a draft would be rejected, and verifying what follows it is wasted work.
    pub(super) fn keep_valid_drafts(&mut self) {
        for seq in self.seqs.iter_mut().filter(|s| !s.drafts.is_empty() && s.logits.options.grammar.is_some()) {
            let valid = seq.logits.valid_drafts(&seq.drafts);
            seq.drafts.truncate(valid);
        }
    }
}

//! Continuous batching: which rows run in the next step, under a token budget and a cap on
//! concurrent sequences, with preemption by recompute when the KV pool runs out.
//!
//! Order within a step: running sequences that generate (decode or verify rows), then running
//! sequences still prefilling, then newly admitted ones. Prompt pieces end at multiples of the
//! delta-rule chunk size (or at the prompt's end), so a prompt's chunks are the same however
//! the steps cut it (DESIGN Invariant 3). With the prefix cache on, an admitted sequence
//! resumes from the longest cached prefix of its prompt, and a piece also ends at the prompt's
//! checkpoint position (see [`super::cache::prefix`]).

use super::cache::{checkpoint_position, BlockPool, PrefixCache, SlotAllocator};
use super::plan::StepPlan;
use super::request::{FreshState, SeqStatus, Sequence, SpecMethod};
use crate::backend::DELTA_RULE_CHUNK as CHUNK;
use crate::backend::{RowKind, StateCheckpoint};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    /// Tokens per step (>= the delta-rule chunk size, so every prompt can progress).
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// Tokens of generate rows per step: each takes a recurrent-state snapshot slot.
    pub max_generate_tokens: usize,
}

pub struct Scheduler {
    pub config: SchedulerConfig,
    pub blocks: BlockPool,
    pub slots: SlotAllocator,
    /// `None` when prefix caching is off.
    pub prefix: Option<PrefixCache>,
    admissions: u64,
    /// Number of preemptions so far (for metrics and tests).
    pub preemptions: u64,
}

/// The step's rows, and the state slots newly given to sequences: zeroed (`fresh_slots`) or
/// copied from a prefix-cache checkpoint (`restores`) before the forward.
pub struct Scheduled {
    pub plan: StepPlan,
    pub fresh_slots: Vec<usize>,
    pub restores: Vec<StateCheckpoint>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, blocks: BlockPool, slots: SlotAllocator, prefix: Option<PrefixCache>) -> Self {
        assert!(config.max_num_batched_tokens >= CHUNK, "token budget must be at least {CHUNK}");
        Scheduler { config, blocks, slots, prefix, admissions: 0, preemptions: 0 }
    }

    /// Prompt tokens to prefill now, given the budget left. With `cut_at_checkpoint`, a piece
    /// that would run past the prompt's checkpoint position ends there, so that the state at
    /// that position exists to be cached.
    fn prefill_piece(seq: &Sequence, budget: usize, cut_at_checkpoint: bool) -> usize {
        let start = seq.num_computed;
        let mut end = if seq.prompt_len - start <= budget { seq.prompt_len } else { (start + budget) / CHUNK * CHUNK };
        let checkpoint = checkpoint_position(seq.prompt_len);
        if cut_at_checkpoint && start < checkpoint && checkpoint < end {
            end = checkpoint;
        }
        end.saturating_sub(start)
    }

    /// A newly admitted sequence resumes from the longest cached prefix of its prompt, if any.
    fn resume_from_cache(&mut self, seq: &mut Sequence) {
        seq.fresh_state = Some(FreshState::Zero);
        let hit = self.prefix.as_mut().and_then(|prefix| prefix.lookup(&mut self.blocks, &seq.tokens[..seq.prompt_len], seq.method == SpecMethod::Mtp));
        let cached = hit.as_ref().map_or(0, |h| h.blocks.len() * self.blocks.block_size());
        seq.cached_tokens.get_or_insert(cached);
        if let Some(hit) = hit {
            seq.block_table = hit.blocks;
            seq.cache_nodes = hit.nodes;
            seq.num_computed = cached;
            seq.fresh_state = Some(FreshState::Checkpoint(hit.checkpoint));
        }
    }

    /// After a prefill piece of `seq` ran: its cacheable blocks join the prefix cache, and if
    /// the piece ended at a checkpoint position, the checkpoint its state must be copied to now
    /// is returned. `draft_kv`: the blocks hold the MTP layer's KV of their positions.
    pub fn record_prefill(&mut self, seq: &mut Sequence, draft_kv: bool) -> Option<StateCheckpoint> {
        let prefix = self.prefix.as_mut()?;
        let checkpoint = prefix.record_prefill(&mut self.blocks, &seq.tokens[..seq.prompt_len], seq.num_computed, &seq.block_table, &mut seq.cache_nodes, draft_kv)?;
        Some(StateCheckpoint { slot: seq.state_slot.expect("a prefilled sequence has a state slot"), checkpoint })
    }

    /// Frees the cache of `seq` and sends it back to waiting, to be recomputed.
    fn preempt(&mut self, seq: &mut Sequence) {
        self.blocks.release(&mut seq.block_table);
        if let Some(slot) = seq.state_slot.take() {
            self.slots.release(slot);
        }
        seq.reset_for_recompute();
        self.preemptions += 1;
    }

    /// Makes room for `need` positions of `seqs[idx]` by preempting the newest running sequences
    /// not yet scheduled this step (possibly `idx` itself). Returns false if `idx` was preempted.
    fn reserve(&mut self, seqs: &mut [Sequence], idx: usize, need: usize, scheduled: &[usize]) -> bool {
        loop {
            let mut table = std::mem::take(&mut seqs[idx].block_table);
            let ok = self.blocks.ensure(&mut table, need).is_ok();
            seqs[idx].block_table = table;
            if ok {
                return true;
            }
            let victim = (0..seqs.len())
                .filter(|&i| seqs[i].status == SeqStatus::Running && !scheduled.contains(&i))
                .max_by_key(|&i| seqs[i].admitted_at)
                .expect("the sequence itself is a candidate");
            self.preempt(&mut seqs[victim]);
            if victim == idx {
                return false;
            }
        }
    }

    /// Builds the next step. `seqs` is in arrival order; finished sequences are already removed.
    pub fn schedule(&mut self, seqs: &mut [Sequence]) -> Scheduled {
        let mut budget = self.config.max_num_batched_tokens;
        let mut plan = StepPlan::default();
        let mut scheduled: Vec<usize> = Vec::new();
        let mut snapshot_cursor = 0usize;
        let cut_at_checkpoint = self.prefix.is_some();

        let mut running: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].status == SeqStatus::Running).collect();
        running.sort_by_key(|&i| seqs[i].admitted_at);

        // 1. Generate rows: committed-but-unfed tokens (one, or several after a recompute) + drafts.
        // A recompute's replay longer than the snapshot slots left is fed over several steps.
        // Drafts leave one token and snapshot for each later decoding sequence, so that a tight
        // snapshot budget trims speculation instead of starving the sequences admitted last.
        let mut snapshots_left = self.config.max_generate_tokens;
        let decoding: Vec<usize> = running.iter().copied().filter(|&i| !seqs[i].in_prefill()).collect();
        for (n_th, &i) in decoding.iter().enumerate() {
            let avail = budget.min(snapshots_left);
            if seqs[i].status != SeqStatus::Running || avail == 0 {
                continue;
            }
            let unfed = seqs[i].tokens.len() - seqs[i].num_computed;
            let committed = unfed.min(avail);
            let mut drafts = if committed == unfed { seqs[i].drafts.clone() } else { Vec::new() };
            let later = decoding.len() - n_th - 1;
            let room = (avail - committed).saturating_sub(later).min(self.config.max_model_len.saturating_sub(seqs[i].num_computed + committed));
            drafts.truncate(room);
            let n = committed + drafts.len();
            if !self.reserve(seqs, i, seqs[i].num_computed + n, &scheduled) {
                continue;
            }
            plan.push_row(&seqs[i], RowKind::Generate, committed, drafts, committed == unfed, snapshot_cursor);
            snapshot_cursor += n;
            budget -= n;
            snapshots_left -= n;
            scheduled.push(i);
        }

        // 2. Prefill pieces of running sequences, then 3. admissions in arrival order.
        let waiting: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].status == SeqStatus::Waiting).collect();
        let candidates = running.into_iter().map(|i| (i, false)).chain(waiting.into_iter().map(|i| (i, true)));
        for (i, admit) in candidates {
            if budget == 0 {
                break;
            }
            if admit {
                if seqs[i].status != SeqStatus::Waiting {
                    continue;
                }
                let active = seqs.iter().filter(|s| s.status == SeqStatus::Running).count();
                if active >= self.config.max_num_seqs {
                    break;
                }
                if Self::prefill_piece(&seqs[i], budget, cut_at_checkpoint) == 0 {
                    break;
                }
                let Ok(slot) = self.slots.allocate() else { break };
                seqs[i].state_slot = Some(slot);
                seqs[i].status = SeqStatus::Running;
                self.admissions += 1;
                seqs[i].admitted_at = self.admissions;
                self.resume_from_cache(&mut seqs[i]);
            } else if seqs[i].status != SeqStatus::Running || !seqs[i].in_prefill() {
                continue;
            }
            let piece = Self::prefill_piece(&seqs[i], budget, cut_at_checkpoint);
            if piece == 0 {
                continue;
            }
            if !self.reserve(seqs, i, seqs[i].num_computed + piece, &scheduled) {
                continue;
            }
            // Sample only at the prompt's end, and only if nothing was generated before a preemption.
            let s = &seqs[i];
            let samples = s.num_computed + piece == s.prompt_len && s.num_generated() == 0;
            plan.push_row(s, RowKind::Prefill, piece, Vec::new(), samples, 0);
            budget -= piece;
            scheduled.push(i);
        }
        // Slots of sequences admitted this step and still running (a preempted one dropped its
        // own); the state is set up before the forward even if no row ran yet.
        let mut fresh_slots = Vec::new();
        let mut restores = Vec::new();
        for seq in seqs.iter_mut().filter(|s| s.status == SeqStatus::Running) {
            let slot = seq.state_slot.expect("a running sequence has a state slot");
            match seq.fresh_state.take() {
                Some(FreshState::Zero) => fresh_slots.push(slot),
                Some(FreshState::Checkpoint(checkpoint)) => restores.push(StateCheckpoint { slot, checkpoint }),
                None => {}
            }
        }
        Scheduled { plan, fresh_slots, restores }
    }

    /// Returns a finished sequence's cache.
    pub fn release(&mut self, seq: &mut Sequence) {
        self.blocks.release(&mut seq.block_table);
        if let Some(slot) = seq.state_slot.take() {
            self.slots.release(slot);
        }
    }
}

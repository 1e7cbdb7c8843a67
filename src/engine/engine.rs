//! The step loop: schedule -> forward -> sample/verify -> commit -> propose -> emit.

pub use super::config::{EngineConfig, EngineError, EngineStats};
use super::cache::{BlockPool, PrefixCache, PrefixCacheStats, SlotAllocator};
use super::logits::grammar::TokenMask;
use super::metrics::SpecStats;
use super::request::{FinishReason, Request, RequestEvent, RequestFailure, RequestId, SeqStatus, Sequence, SequenceSummary, SpecMethod};
use super::scheduler::{Scheduler, SchedulerConfig};
use super::spec::mtp::MtpCatchUp;
use super::spec::ngram::NgramConfig;
use super::graphed::{capture_at_startup, forward, CaptureReport, GraphPadding};
use super::padding::{CaptureSizes, PadLimits, Scratch};
use super::logits::logprobs::TokenLogprob;
use super::plan::{PlannedRow, StepPlan};
use super::spec::backoff::SpecBackoff;
use super::spec::shadow::ShadowDrafts;
use super::spec::verify::{accept_drafts, VerifyOutcome};
use super::step_trace::{Phase, StepTrace};
use crate::backend::sampling::{AllowedTokens, NO_FINITE_LOGIT};
use crate::backend::DELTA_RULE_CHUNK as CHUNK;
use crate::backend::{delta_state_in_place, Backend, BackendError, CacheSpec, RowKind, RowSampling, StateCommit, StepLimits};
use crate::model::arch::qwen35::{ForwardOutput, Qwen35};
use indicatif::ProgressBar;
use rayon::prelude::*;
use std::collections::HashMap;
use std::time::Instant;

mod drafting;

/// A drafter supplied by the caller instead of ngram/MTP: given a request, its committed tokens
/// and the most drafts that can be used, returns the drafts. Tests use it to control exactly
/// which drafts are right.
pub type CustomDrafter = Box<dyn FnMut(RequestId, &[u32], usize) -> Vec<u32> + Send>;

pub struct Engine<B: Backend> {
    custom_drafter: Option<CustomDrafter>,
    pub backend: B,
    pub model: Qwen35<B>,
    cache: B::Cache,
    scheduler: Scheduler,
    seqs: Vec<Sequence>,
    next_id: RequestId,
    pub config: EngineConfig,
    pub stats: EngineStats,
    /// How generate-only steps are padded and graphed; `None` with graphs off.
    graphs: Option<GraphPadding>,
    /// What capturing the graphs at start-up took, where they were.
    pub graph_capture: Option<CaptureReport>,
    /// Chooses each step's drafts per row, with `spec_backoff`.
    backoff: Option<SpecBackoff>,
    /// Drafts per row the rows of the next step were offered.
    offered_drafts: usize,
    /// Ngram drafts not offered (the back-off offered none), checked against the tokens.
    shadow: ShadowDrafts,
    /// Per-phase step times (KESTREL_STEP_TRACE=1), printed when the engine is dropped.
    trace: Option<StepTrace>,
}

impl<B: Backend> Engine<B> {
    pub fn new(backend: B, model: Qwen35<B>, config: EngineConfig) -> Result<Self, EngineError> {
        Engine::with_progress(backend, model, config, &ProgressBar::hidden())
    }

    /// [`Engine::new`], with `progress` following the capture of the graphs.
    pub fn with_progress(backend: B, model: Qwen35<B>, config: EngineConfig, progress: &ProgressBar) -> Result<Self, EngineError> {
        if config.max_num_batched_tokens < CHUNK {
            return Err(EngineError::Config(format!("max_num_batched_tokens must be at least {CHUNK}")));
        }
        if config.max_num_seqs == 0 || config.block_size == 0 || config.num_blocks == 0 {
            return Err(EngineError::Config("max_num_seqs, block_size and num_blocks must be positive".into()));
        }
        NgramConfig { min_n: config.ngram_min, max_n: config.ngram_max, k: config.spec_tokens.max(1) }.validate().map_err(|e| EngineError::Config(e.to_string()))?;
        if config.spec == SpecMethod::Mtp && model.mtp.is_none() {
            return Err(EngineError::NoMtpHead);
        }
        // Checkpoints sit at multiples of the delta-rule chunk, which must be block boundaries.
        if config.prefix_cache_checkpoints > 0 && !CHUNK.is_multiple_of(config.block_size) {
            return Err(EngineError::Config(format!("the prefix cache needs a block size that divides {CHUNK}, got {}", config.block_size)));
        }
        if config.max_cuda_graph_size == Some(0) {
            return Err(EngineError::Config("max_cuda_graph_size must be at least 1".into()));
        }
        let snapshot_slots = config.snapshot_slots(backend.replays_graphs());
        // One KV block and one state slot past those the allocators hand out: padded rows write there.
        let scratch = Scratch::after(config.num_blocks, config.max_num_seqs);
        let spec = CacheSpec {
            kv_dtype: config.kv_dtype,
            checkpoint_slots: config.prefix_cache_checkpoints,
            ..model.cache_spec(config.num_blocks + Scratch::BLOCKS, config.block_size, config.max_num_seqs + Scratch::STATE_SLOTS, snapshot_slots)
        };
        let cache = backend.alloc_cache(&spec).map_err(|e: BackendError| EngineError::Config(e.to_string()))?;
        // A step has at most one row per sequence, and every row's table covers at most the context.
        let limits = StepLimits {
            max_tokens: config.max_num_batched_tokens,
            max_rows: config.max_step_rows(backend.replays_graphs()),
            max_blocks_per_row: (config.max_model_len + config.spec_tokens).div_ceil(config.block_size) + 1,
        };
        backend.reserve_step_inputs(limits).map_err(|e| EngineError::Config(e.to_string()))?;
        let mut cache = cache;
        backend.reset_states(&mut cache, &[scratch.state_slot]);
        let graphs = config.cuda_graphs.then(|| {
            let max = config.max_cuda_graph_size.unwrap_or(config.max_num_seqs).min(config.max_num_seqs);
            let sizes = match &config.cuda_graph_sizes {
                Some(sizes) => sizes.capped(max),
                None if backend.replays_graphs() => CaptureSizes::default_up_to(max),
                None => CaptureSizes::default_up_to(0),
            };
            // A full batch's verify steps need a padded row to pad into (see verify_padding_row).
            let sizes = if config.verify_padding_row(backend.replays_graphs()) { sizes.with_verify_row(config.max_num_seqs) } else { sizes };
            // A padded step's tokens each take a snapshot slot, past the real rows' ones.
            let pad_limits = PadLimits { max_tokens: snapshot_slots.min(limits.max_tokens), max_blocks_per_row: limits.max_blocks_per_row, block_size: config.block_size };
            GraphPadding { sizes, scratch, limits: pad_limits, k: config.spec_tokens }
        });
        let graph_capture = graphs.as_ref().and_then(|g| capture_at_startup(&model, &backend, &mut cache, g, config.spec != SpecMethod::None, config.spec == SpecMethod::Mtp, progress));
        let scheduler = Scheduler::new(
            SchedulerConfig {
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_model_len: config.max_model_len,
                max_generate_tokens: snapshot_slots,
            },
            BlockPool::new(config.num_blocks, config.block_size),
            SlotAllocator::new(config.max_num_seqs),
            (config.prefix_cache_checkpoints > 0).then(|| PrefixCache::new(config.prefix_cache_checkpoints)),
        );
        let backoff = config.spec_backoff.then(|| SpecBackoff::new(config.spec_tokens));
        let offered_drafts = config.spec_tokens;
        Ok(Engine { custom_drafter: None, backend, model, cache, scheduler, seqs: Vec::new(), next_id: 0, config, stats: EngineStats::default(), graphs, graph_capture, backoff, offered_drafts, shadow: ShadowDrafts::default(), trace: StepTrace::from_env() })
    }

    /// The capture sizes steps are padded up to (empty: none, every step at its own shape).
    pub fn capture_sizes(&self) -> CaptureSizes {
        self.graphs.as_ref().map_or(CaptureSizes::default_up_to(0), |g| g.sizes.clone())
    }

    /// The backend and the model back, for another engine (the caches are dropped).
    pub fn into_parts(self) -> (B, Qwen35<B>) {
        (self.backend, self.model)
    }

    /// The k reported in a request's speculation statistics (0 when it did not speculate).
    pub fn reported_k(&self, method: SpecMethod) -> usize {
        if method == SpecMethod::None {
            0
        } else {
            self.config.spec_tokens
        }
    }

    /// Replaces the proposers of every speculating request (method other than `none`).
    pub fn set_custom_drafter(&mut self, drafter: Option<CustomDrafter>) {
        self.custom_drafter = drafter;
    }

    /// Validates and queues a request.
    pub fn add_request(&mut self, req: Request) -> Result<RequestId, EngineError> {
        if req.prompt_ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&id) = req.prompt_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { id, vocab });
        }
        req.params.validate().map_err(|e| EngineError::Sampling(e.to_string()))?;
        req.logits.validate(vocab).map_err(EngineError::Sampling)?;
        let total = req.prompt_ids.len() + req.max_tokens;
        if total > self.config.max_model_len {
            return Err(EngineError::ContextExceeded { prompt: req.prompt_ids.len(), max_tokens: req.max_tokens, context: self.config.max_model_len });
        }
        // Room for the whole sequence plus a full verify row.
        let need = self.scheduler.blocks.blocks_for(total + self.config.spec_tokens);
        if need > self.scheduler.blocks.num_total() {
            return Err(EngineError::CacheTooSmall { need, total: self.scheduler.blocks.num_total() });
        }
        let method = req.spec.unwrap_or(self.config.spec);
        if method == SpecMethod::Mtp && self.model.mtp.is_none() {
            return Err(EngineError::NoMtpHead);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.push(Sequence::new(id, req, method));
        Ok(id)
    }

    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.seqs.iter().filter(|s| s.status == SeqStatus::Running).count()
    }

    pub fn num_waiting(&self) -> usize {
        self.seqs.iter().filter(|s| s.status == SeqStatus::Waiting).count()
    }

    pub fn preemptions(&self) -> u64 {
        self.scheduler.preemptions
    }

    /// (used, total) KV blocks and recurrent-state slots.
    pub fn cache_usage(&self) -> ((usize, usize), (usize, usize)) {
        let b = &self.scheduler.blocks;
        ((b.num_total() - b.num_free(), b.num_total()), (self.scheduler.slots.num_used(), self.scheduler.slots.num_total()))
    }

    /// Prefix-cache counters; `None` when prefix caching is off.
    pub fn prefix_cache_stats(&self) -> Option<PrefixCacheStats> {
        self.scheduler.prefix.as_ref().map(|p| p.stats(&self.scheduler.blocks))
    }

    /// Speculation counters of a request still in flight, for live displays (a finished
    /// request's counters are in its summary and in `stats.spec`).
    pub fn request_spec_stats(&self, id: RequestId) -> Option<&SpecStats> {
        self.seqs.iter().find(|s| s.id == id).map(|s| &s.spec)
    }

    /// Cancels a request and frees its cache. Its speculation counters stay in the engine's
    /// totals: the drafts it verified were real work.
    pub fn abort(&mut self, id: RequestId) -> Result<RequestEvent, EngineError> {
        let idx = self.seqs.iter().position(|s| s.id == id).ok_or(EngineError::UnknownRequest(id))?;
        let mut seq = self.seqs.remove(idx);
        self.scheduler.release(&mut seq);
        self.stats.spec.merge(&seq.spec);
        self.shadow.forget(id);
        Ok(finished_event(seq, FinishReason::Abort))
    }

    /// Runs one step and returns what it produced.
    pub fn step(&mut self) -> Vec<RequestEvent> {
        let mut events = Vec::new();
        // The back-off weighs what a whole step costs (everything up to its commits).
        let started = Instant::now();
        self.lap(None);
        let scheduled = self.scheduler.schedule(&mut self.seqs);
        self.backend.reset_states(&mut self.cache, &scheduled.fresh_slots);
        self.backend.restore_checkpoints(&mut self.cache, &scheduled.restores);
        self.lap(Some(Phase::Schedule));
        let plan = scheduled.plan;
        if plan.is_empty() {
            // Every queued request is admissible (checked in add_request) and the budget always
            // fits a prefill chunk, so an empty plan with work left would stall the caller.
            assert!(self.seqs.is_empty(), "scheduler produced no rows with {} requests queued", self.seqs.len());
            return events;
        }
        let (out, mut masks) = self.forward_with_masks(&plan);
        // Invariant 2: a padded step comes back cut to the plan's real rows.
        assert_eq!(self.backend.shape(&out.logits).0, plan.logit_rows.len(), "the forward returned logits of rows the plan does not have");
        assert_eq!(self.backend.shape(&out.hidden).0, plan.num_tokens(), "the forward returned hidden states of tokens the plan does not have");
        let draws = self.row_sampling(&plan, &mut masks);
        let host_rows: Vec<bool> = draws.iter().map(|d| d.on_host).collect();
        let (sampled, host_logits) = self.draw_rows(&out.logits, draws, &host_rows);
        self.lap(Some(Phase::DeviceDraw));
        let mut host_draws = self.draw_on_host(&plan, &host_rows, &host_logits, masks);
        self.lap(Some(Phase::HostDraw));
        self.stats.steps += 1;
        self.stats.forward_tokens += plan.num_tokens() as u64;

        let mut finished: Vec<(RequestId, Result<FinishReason, RequestFailure>)> = Vec::new();
        let mut commits: Vec<StateCommit> = Vec::new();
        let mut checkpoint_saves = Vec::new();
        let has_mtp_head = self.model.mtp.is_some();
        // With whether each catch-up is of a prompt piece (see `propose`).
        let mut mtp_items: Vec<(RequestId, MtpCatchUp, bool)> = Vec::new();
        for (row, layout) in plan.rows.iter().zip(&plan.layout.rows) {
            let Some(seq) = self.seqs.iter_mut().find(|s| s.id == row.seq) else { continue };
            let start = seq.num_computed;
            let mut emitted = Vec::new();
            let mut logprobs = Vec::new();
            let mut committed_now = row.committed;
            let conv_only = delta_state_in_place(layout.kind, layout.num_tokens);
            // Rows adjusted or read on the host were drawn there, by the same rule.
            let drawn_on_host = host_draws.remove(&row.seq);
            match (row.kind, row.logits_start) {
                (RowKind::Prefill, sample) => {
                    seq.num_computed += row.committed;
                    match drawn_on_host {
                        Some((outcome, row_logprobs)) => {
                            emitted = outcome.tokens;
                            logprobs = row_logprobs;
                        }
                        None => emitted.extend(sample.map(|l| sampled[l])),
                    }
                }
                (RowKind::Generate, Some(l)) => {
                    let outcome = match drawn_on_host {
                        Some((outcome, row_logprobs)) => {
                            logprobs = row_logprobs;
                            outcome
                        }
                        None => accept_drafts(&sampled[l..=l + row.drafts.len()], &row.drafts).expect("the plan gives every draft a logits row"),
                    };
                    // Invariant 1: the state at the last accepted token becomes canonical (below,
                    // for every row at once, before the step ends).
                    commits.push(StateCommit { slot: layout.state_slot, snapshot: layout.snapshot_base + row.committed - 1 + outcome.accepted, conv_only });
                    committed_now = row.committed + outcome.accepted;
                    seq.num_computed += committed_now;
                    if seq.spec.record_step(row.drafts.len(), outcome.accepted).is_err() {
                        debug_assert!(false, "verify returned more accepted drafts than drafted");
                    }
                    if let Some(backoff) = self.backoff.as_mut().filter(|_| self.custom_drafter.is_none()) {
                        backoff.record_row(seq.method, self.offered_drafts, row.drafts.len(), outcome.accepted);
                    }
                    emitted = outcome.tokens;
                }
                (RowKind::Generate, None) => {
                    // Replay of committed tokens after a recompute: no sampling.
                    commits.push(StateCommit { slot: layout.state_slot, snapshot: layout.snapshot_base + row.committed - 1, conv_only });
                    seq.num_computed += row.committed;
                }
            }
            let mut reason = None;
            let mut new_tokens = Vec::new();
            for t in emitted {
                if t == NO_FINITE_LOGIT {
                    reason = Some(Err(RequestFailure::NonFiniteLogits { position: seq.num_generated() }));
                    break;
                }
                if seq.stop_token_ids.contains(&t) {
                    reason = Some(Ok(FinishReason::Stop));
                    break;
                }
                seq.tokens.push(t);
                new_tokens.push(t);
                if seq.num_generated() >= seq.max_tokens {
                    reason = Some(Ok(FinishReason::Length));
                    break;
                }
            }
            if let Some(backoff) = self.backoff.as_mut() {
                if let Some((drafted, accepted)) = self.shadow.settle(seq.id, &seq.tokens) {
                    backoff.record_row(seq.method, self.config.spec_tokens, drafted, accepted);
                }
            }
            if !new_tokens.is_empty() {
                let committing = self.trace.as_ref().map(|_| Instant::now());
                seq.logits.commit(&new_tokens);
                if let (Some(trace), Some(t)) = (self.trace.as_mut(), committing) {
                    trace.add_grammar_commit(t.elapsed());
                }
                logprobs.truncate(new_tokens.len());
                seq.logprobs.extend(logprobs.iter().cloned());
                events.push(RequestEvent::Tokens { id: seq.id, tokens: new_tokens, logprobs, cached_tokens: seq.cached_tokens.unwrap_or(0) });
            }
            if row.kind == RowKind::Prefill {
                // The MTP layer's KV of this piece is written by the catch-up below (propose),
                // before any later admission can look the blocks up.
                let draft_kv = !has_mtp_head || (seq.method == SpecMethod::Mtp && self.custom_drafter.is_none() && reason.is_none());
                checkpoint_saves.extend(self.scheduler.record_prefill(seq, draft_kv));
            }
            match reason {
                Some(r) => finished.push((seq.id, r)),
                None if seq.method == SpecMethod::Mtp => {
                    let want = if seq.in_prefill() { 0 } else { self.config.spec_tokens };
                    mtp_items.push((
                        seq.id,
                        MtpCatchUp {
                            start_position: start,
                            hidden_start: layout.token_start,
                            count: committed_now,
                            next_tokens: seq.tokens[start + 1..start + committed_now + 1].to_vec(),
                            block_table: seq.block_table.clone(),
                            drafts_wanted: want,
                        },
                        row.kind == RowKind::Prefill,
                    ));
                }
                None => {}
            }
        }

        self.backend.save_checkpoints(&mut self.cache, &checkpoint_saves);
        self.backend.commit_states(&mut self.cache, &commits);
        for (id, ending) in finished {
            self.shadow.forget(id);
            if let Some(idx) = self.seqs.iter().position(|s| s.id == id) {
                let mut seq = self.seqs.remove(idx);
                self.scheduler.release(&mut seq);
                self.stats.spec.merge(&seq.spec);
                events.push(match ending {
                    Ok(reason) => finished_event(seq, reason),
                    Err(error) => RequestEvent::Failed { id, error, output: summary(seq) },
                });
            }
        }
        self.lap(Some(Phase::Commit));
        if let Some(backoff) = self.backoff.as_mut().filter(|_| plan.rows.iter().all(|r| r.kind == RowKind::Generate)) {
            backoff.record_step(plan.num_tokens(), started.elapsed().as_secs_f64());
        }
        self.propose(&out.hidden, mtp_items);
        self.lap(Some(Phase::Propose));
        events
    }

    /// Closes the trace's current phase (`None`: a step starts).
    fn lap(&mut self, phase: Option<Phase>) {
        if let Some(trace) = self.trace.as_mut() {
            match phase {
                Some(phase) => trace.lap(phase),
                None => trace.start_step(),
            }
        }
    }

    /// The step's forward, and the grammar masks of the rows that have a grammar, by request.
    /// A row's first mask was computed ahead on the thread pool when its last tokens were
    /// committed; the masks of a row's drafts are computed on another thread while the forward
    /// runs (they depend only on committed tokens and drafts).
    fn forward_with_masks(&mut self, plan: &StepPlan) -> (ForwardOutput<B>, HashMap<RequestId, Vec<TokenMask>>) {
        let constrained: HashMap<RequestId, Vec<u32>> = plan
            .rows
            .iter()
            .filter(|r| r.logits_start.is_some())
            .filter(|r| self.seqs.iter().any(|s| s.id == r.seq && s.logits.options.grammar.is_some()))
            .map(|r| (r.seq, r.drafts.clone()))
            .collect();
        let (unconstrained, first_masks_only) = (constrained.is_empty(), constrained.values().all(Vec::is_empty));
        let (model, backend, cache, graphs, seqs, trace) = (&self.model, &self.backend, &mut self.cache, self.graphs.as_ref(), &mut self.seqs, &mut self.trace);
        let block_size = self.config.block_size;
        // Each sequence's grammar is its own matcher: their masks are computed in parallel.
        let row_masks = move |seqs: &mut Vec<Sequence>| {
            seqs.par_iter_mut()
                .filter_map(|seq| {
                    let drafts = constrained.get(&seq.id)?;
                    Some((seq.id, (seq.logits.masks(drafts), seq.logits.take_grammar_work())))
                })
                .collect::<HashMap<_, _>>()
        };
        let (out, shapes, masks) = if first_masks_only {
            // Only first masks, computed ahead: nothing to overlap but the wait for them.
            let (out, shapes) = forward(model, backend, cache, graphs, plan, block_size);
            if let Some(trace) = trace.as_mut() {
                trace.lap(Phase::Forward);
            }
            (out, shapes, if unconstrained { HashMap::new() } else { row_masks(seqs) })
        } else {
            std::thread::scope(|scope| {
                let masks = scope.spawn(move || row_masks(seqs));
                let (out, shapes) = forward(model, backend, cache, graphs, plan, block_size);
                if let Some(trace) = trace.as_mut() {
                    trace.lap(Phase::Forward);
                }
                (out, shapes, masks.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            })
        };
        if let Some(trace) = trace.as_mut() {
            trace.lap(Phase::MaskWait);
            masks.values().for_each(|(_, took)| trace.add_mask_work(*took));
        }
        self.record_padding(shapes);
        (out, masks.into_iter().map(|(id, (masks, _))| (id, masks)).collect())
    }

    fn record_padding(&mut self, shapes: Option<(crate::backend::RealShape, crate::backend::PaddedShape)>) {
        if let Some((real, shape)) = shapes {
            self.stats.padding.record(real, shape);
        }
    }

    /// Draws every logits row: rows of requests with plain sampling on the backend, the others
    /// copied to the host (returned by logits row index) for [`LogitsState::draw`].
    fn draw_rows(&self, logits: &B::Tensor, draws: Vec<RowDraw>, host_rows: &[bool]) -> (Vec<u32>, HashMap<usize, Vec<f32>>) {
        if !host_rows.iter().any(|&h| h) {
            let specs: Vec<RowSampling> = draws.into_iter().map(|d| d.sampling).collect();
            return (self.backend.sample_rows(logits, &specs), HashMap::new());
        }
        let (device, host): (Vec<usize>, Vec<usize>) = (0..draws.len()).partition(|&i| !host_rows[i]);
        let mut sampled = vec![u32::MAX; draws.len()];
        if !device.is_empty() {
            let indices: Vec<u32> = device.iter().map(|&i| i as u32).collect();
            let specs: Vec<RowSampling> = device.iter().map(|&i| draws[i].sampling.clone()).collect();
            let tokens = self.backend.sample_rows(&self.backend.gather_rows(logits, &indices), &specs);
            for (&i, token) in device.iter().zip(tokens) {
                sampled[i] = token;
            }
        }
        let vocab = self.model.config.vocab_size;
        let copied = self.backend.logits_rows_to_host(logits, &host);
        let host_logits = host.iter().enumerate().map(|(k, &i)| (i, copied[k * vocab..(k + 1) * vocab].to_vec())).collect();
        (sampled, host_logits)
    }

    /// Draws the rows of `plan` whose logits came to the host (`host_logits`, by logits row),
    /// each request's rows with its own masks, the requests in parallel: a draw depends only on
    /// the row's logits, drafts and position, so the order they run in changes nothing.
    fn draw_on_host(&mut self, plan: &StepPlan, host_rows: &[bool], host_logits: &HashMap<usize, Vec<f32>>, mut masks: HashMap<RequestId, Vec<TokenMask>>) -> HashMap<RequestId, (VerifyOutcome, Vec<TokenLogprob>)> {
        let vocab = self.model.config.vocab_size;
        let work: HashMap<RequestId, (&PlannedRow, usize, Vec<TokenMask>)> = plan
            .rows
            .iter()
            .filter_map(|row| row.logits_start.filter(|&l| host_rows[l]).map(|l| (row.seq, (row, l, masks.remove(&row.seq).unwrap_or_default()))))
            .collect();
        if work.is_empty() {
            return HashMap::new();
        }
        // A sequence is drawn by the thread that holds it mutably: its grammar matcher is Send,
        // not shareable.
        self.seqs
            .par_iter_mut()
            .filter_map(|seq| {
                let (row, l, row_masks) = work.get(&seq.id)?;
                let rows: Vec<&[f32]> = (*l..=l + row.drafts.len()).map(|r| &host_logits[&r][..vocab]).collect();
                Some((seq.id, seq.logits.draw(&rows, &row.drafts, row_masks, &seq.params, seq.num_generated() as u64)))
            })
            .collect()
    }

    /// How to draw each logits row of `plan`: a prefill row that samples predicts the request's
    /// next output position; a generate row's rows predict consecutive positions from there. A
    /// row drawn on the backend takes its position's grammar mask out of `masks` (the backend
    /// masks it where the logits are); a row drawn on the host leaves its masks there.
    fn row_sampling(&self, plan: &StepPlan, masks: &mut HashMap<RequestId, Vec<TokenMask>>) -> Vec<RowDraw> {
        let mut rows = Vec::with_capacity(plan.logit_rows.len());
        for row in plan.rows.iter() {
            if row.logits_start.is_none() {
                continue;
            }
            debug_assert_eq!(row.logits_start, Some(rows.len()), "logits rows follow row order");
            let seq = self.seqs.iter().find(|s| s.id == row.seq).expect("a planned row belongs to a live sequence");
            let first = seq.num_generated() as u64;
            let count = if row.kind == RowKind::Prefill { 1 } else { row.drafts.len() + 1 };
            let on_host = seq.logits.needs_host();
            let row_masks = if on_host { Vec::new() } else { masks.remove(&row.seq).unwrap_or_default() };
            rows.extend((0..count).map(|i| {
                let allowed = row_masks.get(i).and_then(Option::as_ref).map(|mask| AllowedTokens::from(mask.as_slice()));
                RowDraw { sampling: RowSampling { params: seq.params.clone(), position: first + i as u64, allowed }, on_host }
            }));
        }
        rows
    }

    /// Runs every queued request to completion, returning events in order.
    pub fn run_to_completion(&mut self) -> Vec<RequestEvent> {
        let mut all = Vec::new();
        while self.has_unfinished() {
            let ev = self.step();
            all.extend(ev);
        }
        all
    }
}

fn finished_event(seq: Sequence, reason: FinishReason) -> RequestEvent {
    RequestEvent::Finished { id: seq.id, reason, output: summary(seq) }
}

fn summary(seq: Sequence) -> SequenceSummary {
    SequenceSummary { prompt_tokens: seq.prompt_len, generated: seq.tokens[seq.prompt_len..].to_vec(), logprobs: seq.logprobs, spec: seq.spec, method: seq.method, cached_tokens: seq.cached_tokens.unwrap_or(0) }
}

/// How one logits row is drawn: by `sampling`, on the backend unless `on_host`.
struct RowDraw {
    sampling: RowSampling,
    on_host: bool,
}

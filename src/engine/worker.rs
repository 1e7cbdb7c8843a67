//! The engine worker: one dedicated thread owns the [`Engine`] and runs its step loop, and every
//! front end (the HTTP server, the TUI) talks to it over channels.
//!
//! The engine is built on the worker thread by a factory closure and never leaves it, so backends
//! whose state is tied to a thread (a CUDA context, captured graphs) need not be shareable. The
//! tokio runtime never runs a forward pass: a step can take far longer than an async task may block.
//!
//! Concurrent requests are queued into the same engine and share its batch (continuous batching).
//! Each request gets its own event channel; dropping the [`Generation`] that receives it cancels the
//! request and frees its cache, which is how a client that disconnects releases its work.

use crate::backend::Backend;
use crate::engine::cache::PrefixCacheStats;
use crate::engine::logits::logprobs::TokenLogprob;
use crate::engine::metrics::SpecStats;
use crate::engine::request::{FinishReason, Request, RequestEvent, RequestFailure, RequestId, SequenceSummary, SpecMethod};
use crate::engine::{Engine, EngineError};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// How often an idle worker refreshes its snapshot (so tokens/s decays to 0 when nothing runs).
const IDLE_TICK: Duration = Duration::from_millis(200);
/// The window over which tokens/s is measured.
const RATE_WINDOW: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("the engine could not start: {0}")]
    Startup(String),
    #[error("the engine worker has stopped")]
    Stopped,
    #[error("cannot start the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
}

/// What a front end hears about one request, in order: `Accepted` or `Rejected` first, then any
/// number of `Tokens`, then `Finished` or `Failed`.
#[derive(Debug)]
pub enum GenerationEvent {
    Accepted,
    /// The engine refused the request (too long, invalid parameters, ...); nothing else follows.
    Rejected(EngineError),
    /// Tokens produced by one step (with their log probabilities when the request asked), the
    /// request's speculation counters so far and the prompt tokens it took from the prefix cache.
    Tokens { tokens: Vec<u32>, logprobs: Vec<TokenLogprob>, spec: SpecStats, cached_tokens: usize },
    Finished { reason: FinishReason, summary: SequenceSummary },
    /// The request ended with an error after it started (the others go on).
    Failed { error: RequestFailure, summary: SequenceSummary },
}

/// Fixed facts about the engine, read once when it starts.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub backend: &'static str,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub vocab_size: usize,
    /// The engine's default speculation method (requests may override it).
    pub spec: SpecMethod,
    pub spec_tokens: usize,
    pub has_mtp_head: bool,
}

/// Live figures, refreshed after every step (and every [`IDLE_TICK`] while idle).
#[derive(Debug, Clone, Default)]
pub struct EngineSnapshot {
    /// False once the worker thread has ended (shut down or crashed).
    pub alive: bool,
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    pub state_slots_used: usize,
    pub state_slots_total: usize,
    /// Speculation counters of finished requests plus those in flight.
    pub spec: SpecStats,
    /// Prefix-cache counters; `None` when prefix caching is off.
    pub prefix_cache: Option<PrefixCacheStats>,
    /// CUDA graph capture sizes (empty: no padding) and the padding of the steps run at them.
    pub capture_sizes: Vec<usize>,
    pub padding: crate::engine::padding::PaddingStats,
    pub steps: u64,
    pub preemptions: u64,
    pub generated_tokens: u64,
    /// Generated tokens per second over the last couple of seconds, all requests together.
    pub tokens_per_second: f64,
    pub requests_accepted: u64,
    pub requests_rejected: u64,
    pub requests_finished: u64,
    /// Finished because they were cancelled (client gone, Ctrl-C, ...).
    pub requests_cancelled: u64,
    /// Ended with an error (a model that produced no finite logits, ...).
    pub requests_failed: u64,
}

enum Command {
    Submit { ticket: u64, request: Box<Request>, events: UnboundedSender<GenerationEvent> },
    Cancel { ticket: u64 },
    Shutdown,
}

/// A cheap, cloneable way to reach the worker from any thread or task.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    snapshot: Arc<Mutex<EngineSnapshot>>,
    next_ticket: Arc<AtomicU64>,
    info: Arc<EngineInfo>,
}

impl EngineHandle {
    /// Queues a request. The returned [`Generation`] yields its events; dropping it cancels the request.
    pub fn submit(&self, request: Request) -> Result<Generation, WorkerError> {
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let (events_tx, events_rx) = unbounded_channel();
        self.commands.send(Command::Submit { ticket, request: Box::new(request), events: events_tx }).map_err(|_| WorkerError::Stopped)?;
        Ok(Generation { ticket, events: events_rx, commands: self.commands.clone(), done: false })
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        self.snapshot.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }
}

/// The receiving end of one request. Dropped before `Finished` arrives, it cancels the request.
pub struct Generation {
    ticket: u64,
    events: UnboundedReceiver<GenerationEvent>,
    commands: mpsc::Sender<Command>,
    done: bool,
}

impl Generation {
    /// The next event; `None` when the worker stopped without finishing the request.
    pub async fn next(&mut self) -> Option<GenerationEvent> {
        let event = self.events.recv().await;
        self.note(&event);
        event
    }

    /// The next event if one is ready (for loops that are not async, like the TUI).
    /// `Err(WorkerError::Stopped)` when the worker ended without finishing the request.
    pub fn try_next(&mut self) -> Result<Option<GenerationEvent>, WorkerError> {
        match self.events.try_recv() {
            Ok(event) => {
                let event = Some(event);
                self.note(&event);
                Ok(event)
            }
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => Err(WorkerError::Stopped),
        }
    }

    /// Asks the engine to stop this request; a `Finished` event with reason `abort` follows.
    pub fn cancel(&self) {
        if !self.done {
            // A worker that is gone has nothing left to cancel.
            let _ = self.commands.send(Command::Cancel { ticket: self.ticket });
        }
    }

    /// True once `Finished`, `Failed` or `Rejected` was received.
    pub fn is_done(&self) -> bool {
        self.done
    }

    fn note(&mut self, event: &Option<GenerationEvent>) {
        if matches!(event, None | Some(GenerationEvent::Finished { .. }) | Some(GenerationEvent::Failed { .. }) | Some(GenerationEvent::Rejected(_))) {
            self.done = true;
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// Owns the worker thread; dropping it shuts the engine down and waits for the thread.
pub struct EngineWorker {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
}

impl EngineWorker {
    /// Starts the worker thread, builds the engine on it with `factory`, and returns once the
    /// engine is ready (or failed to build).
    pub fn spawn<B, F, E>(factory: F) -> Result<Self, WorkerError>
    where
        B: Backend + 'static,
        F: FnOnce() -> Result<Engine<B>, E> + Send + 'static,
        E: std::fmt::Display,
    {
        let (commands_tx, commands_rx) = mpsc::channel();
        let snapshot = Arc::new(Mutex::new(EngineSnapshot::default()));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<EngineInfo, String>>();
        let shared = snapshot.clone();
        let thread = std::thread::Builder::new().name("kestrel-engine".into()).spawn(move || {
            let engine = match factory() {
                Ok(engine) => engine,
                Err(err) => {
                    let _ = ready_tx.send(Err(err.to_string()));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(info_of(&engine)));
            let _marks_dead_on_exit = AliveFlag(shared.clone());
            WorkerLoop::new(engine, commands_rx, shared).run();
        })?;
        let info = match ready_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(message)) => {
                let _ = thread.join();
                return Err(WorkerError::Startup(message));
            }
            Err(_) => {
                // The factory panicked: the thread is gone without a word.
                let _ = thread.join();
                return Err(WorkerError::Startup("the engine thread ended while starting".into()));
            }
        };
        let handle = EngineHandle { commands: commands_tx, snapshot, next_ticket: Arc::new(AtomicU64::new(0)), info: Arc::new(info) };
        Ok(EngineWorker { handle, thread: Some(thread) })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops the engine (requests in flight end without a `Finished` event) and joins the thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.handle.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for EngineWorker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Marks the snapshot dead when the worker loop ends, also when it ends by a panic.
struct AliveFlag(Arc<Mutex<EngineSnapshot>>);

impl Drop for AliveFlag {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).alive = false;
    }
}

fn info_of<B: Backend>(engine: &Engine<B>) -> EngineInfo {
    EngineInfo {
        backend: engine.backend.name(),
        max_model_len: engine.config.max_model_len,
        max_num_seqs: engine.config.max_num_seqs,
        vocab_size: engine.model.config.vocab_size,
        spec: engine.config.spec,
        spec_tokens: engine.config.spec_tokens,
        has_mtp_head: engine.model.mtp.is_some(),
    }
}

/// A request the engine is working on, and where its events go.
struct LiveRequest {
    ticket: u64,
    events: UnboundedSender<GenerationEvent>,
}

struct WorkerLoop<B: Backend> {
    engine: Engine<B>,
    commands: mpsc::Receiver<Command>,
    shared: Arc<Mutex<EngineSnapshot>>,
    live: HashMap<RequestId, LiveRequest>,
    by_ticket: HashMap<u64, RequestId>,
    rate: TokenRate,
    counters: EngineSnapshot,
}

impl<B: Backend> WorkerLoop<B> {
    fn new(engine: Engine<B>, commands: mpsc::Receiver<Command>, shared: Arc<Mutex<EngineSnapshot>>) -> Self {
        WorkerLoop { engine, commands, shared, live: HashMap::new(), by_ticket: HashMap::new(), rate: TokenRate::default(), counters: EngineSnapshot::default() }
    }

    fn run(mut self) {
        self.publish();
        loop {
            if !self.take_commands() {
                return;
            }
            if self.engine.has_unfinished() {
                let events = self.engine.step();
                self.dispatch(events);
            }
            self.publish();
        }
    }

    /// Applies pending commands, waiting for one when the engine is idle. False means stop.
    fn take_commands(&mut self) -> bool {
        if !self.engine.has_unfinished() {
            match self.commands.recv_timeout(IDLE_TICK) {
                Ok(command) => {
                    if !self.apply(command) {
                        return false;
                    }
                }
                Err(RecvTimeoutError::Timeout) => return true,
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        // Everything already queued joins this step, so a burst of requests is batched together.
        loop {
            match self.commands.try_recv() {
                Ok(command) => {
                    if !self.apply(command) {
                        return false;
                    }
                }
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    fn apply(&mut self, command: Command) -> bool {
        match command {
            Command::Submit { ticket, request, events } => match self.engine.add_request(*request) {
                Ok(id) => {
                    self.counters.requests_accepted += 1;
                    self.live.insert(id, LiveRequest { ticket, events });
                    self.by_ticket.insert(ticket, id);
                    // Whoever hears `Accepted` and then reads the snapshot must find the request in it.
                    self.publish();
                    let accepted = self.live.get(&id).is_some_and(|live| live.events.send(GenerationEvent::Accepted).is_ok());
                    if !accepted {
                        // Gone before it started: nothing to run.
                        self.abort(id);
                    }
                }
                Err(err) => {
                    self.counters.requests_rejected += 1;
                    let _ = events.send(GenerationEvent::Rejected(err));
                }
            },
            Command::Cancel { ticket } => {
                if let Some(&id) = self.by_ticket.get(&ticket) {
                    self.abort(id);
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    /// Stops a request, frees its cache and tells its owner (if still listening).
    fn abort(&mut self, id: RequestId) {
        if let Ok(RequestEvent::Finished { reason, output, .. }) = self.engine.abort(id) {
            self.counters.requests_cancelled += 1;
            self.counters.requests_finished += 1;
            if let Some(live) = self.forget(id) {
                let _ = live.events.send(GenerationEvent::Finished { reason, summary: output });
            }
        }
    }

    fn forget(&mut self, id: RequestId) -> Option<LiveRequest> {
        let live = self.live.remove(&id)?;
        self.by_ticket.remove(&live.ticket);
        Some(live)
    }

    fn dispatch(&mut self, events: Vec<RequestEvent>) {
        let mut gone = Vec::new();
        for event in events {
            match event {
                RequestEvent::Tokens { id, tokens, logprobs, cached_tokens } => {
                    self.counters.generated_tokens += tokens.len() as u64;
                    self.rate.record(tokens.len());
                    let Some(live) = self.live.get(&id) else { continue };
                    let spec = self.engine.request_spec_stats(id).cloned().unwrap_or_default();
                    if live.events.send(GenerationEvent::Tokens { tokens, logprobs, spec, cached_tokens }).is_err() {
                        gone.push(id);
                    }
                }
                RequestEvent::Finished { id, reason, output } => {
                    self.counters.requests_finished += 1;
                    if reason == FinishReason::Abort {
                        self.counters.requests_cancelled += 1;
                    }
                    if let Some(live) = self.forget(id) {
                        let _ = live.events.send(GenerationEvent::Finished { reason, summary: output });
                    }
                }
                RequestEvent::Failed { id, error, output } => {
                    self.counters.requests_finished += 1;
                    self.counters.requests_failed += 1;
                    if let Some(live) = self.forget(id) {
                        let _ = live.events.send(GenerationEvent::Failed { error, summary: output });
                    }
                }
            }
        }
        // Nobody is listening to these any more (the receiver was dropped without a cancel).
        for id in gone {
            self.abort(id);
        }
    }

    fn publish(&mut self) {
        let ((blocks_used, blocks_total), (slots_used, slots_total)) = self.engine.cache_usage();
        let mut spec = self.engine.stats.spec.clone();
        for &id in self.live.keys() {
            if let Some(stats) = self.engine.request_spec_stats(id) {
                spec.merge(stats);
            }
        }
        let snapshot = EngineSnapshot {
            alive: true,
            running: self.engine.num_running(),
            waiting: self.engine.num_waiting(),
            kv_blocks_used: blocks_used,
            kv_blocks_total: blocks_total,
            state_slots_used: slots_used,
            state_slots_total: slots_total,
            spec,
            prefix_cache: self.engine.prefix_cache_stats(),
            capture_sizes: self.engine.capture_sizes().sizes().to_vec(),
            padding: self.engine.stats.padding,
            steps: self.engine.stats.steps,
            preemptions: self.engine.preemptions(),
            tokens_per_second: self.rate.per_second(Instant::now()),
            ..self.counters.clone()
        };
        *self.shared.lock().unwrap_or_else(PoisonError::into_inner) = snapshot;
    }
}

/// Tokens per second over a sliding window.
#[derive(Default)]
struct TokenRate {
    samples: VecDeque<(Instant, usize)>,
}

impl TokenRate {
    fn record(&mut self, tokens: usize) {
        self.samples.push_back((Instant::now(), tokens));
    }

    fn per_second(&mut self, now: Instant) -> f64 {
        while self.samples.front().is_some_and(|(at, _)| now.duration_since(*at) > RATE_WINDOW) {
            self.samples.pop_front();
        }
        let Some(&(oldest, _)) = self.samples.front() else { return 0.0 };
        let tokens: usize = self.samples.iter().map(|(_, n)| n).sum();
        // Right after a burst starts, the span is short: measure over at least a quarter second so
        // one step does not read as an enormous rate.
        let span = now.duration_since(oldest).max(Duration::from_millis(250)).as_secs_f64();
        tokens as f64 / span
    }
}

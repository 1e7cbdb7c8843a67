//! CUDA graphs of whole decode forwards (DESIGN Invariant 4).
//!
//! A forward of generate rows only (decodes and verify rows, every token sampled) launches the
//! same kernels with the same arguments for a given row and token count: its per-step inputs
//! (ids, the packed layout, the logits rows) sit in persistent buffers at fixed addresses, with
//! offsets that depend only on those counts (see layout.rs), and every grid size is a function
//! of the shapes. So the first such forward of each key is captured, and later steps write
//! their inputs into those buffers and replay it. The engine pads steps up to capture sizes,
//! whose keys are captured at start-up (or after one eager forward, [`CaptureWhen::Now`]),
//! each after an eager forward of its shape has made what such a forward makes on first use
//! (rope tables, run-time compiled kernels: a capture would record their uploads); a step no capture
//! size holds keeps its exact key, captured on its [`CAPTURE_AFTER`]th forward (a capture costs
//! a few eager forwards, and such keys may occur only once or twice). Past [`MAX_GRAPHS`] keys,
//! forwards run eagerly. Outputs are token-indexed; only the real tokens' rows are copied out.
//!
//! Activations are allocated inside the graph (stream-ordered allocation nodes) and all of
//! them are freed inside it too: the outputs are first copied into buffers shared by every
//! graph (graphs run one at a time and each step copies its outputs out at once), so graphs
//! can share their activation memory. A new cache (other KV and state addresses) drops every
//! graph, and so does growing the shared output buffers.

use super::{ck, CudaBackend, CudaTensor};
use cudarc::driver::CudaSlice;
use crate::backend::{Backend, BackendError, CaptureWhen, GraphInputs, GraphKey, Real};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Most graphs kept: every row count with every verify-row length of a busy engine.
const MAX_GRAPHS: usize = 512;

/// Forwards of one key before it is captured (the earlier ones run eagerly).
const CAPTURE_AFTER: u32 = 3;

struct CapturedForward {
    /// Shapes of the outputs the graph leaves in the shared output buffers.
    shapes: Vec<(usize, usize)>,
    graph: OwnedGraph,
}

/// An instantiated graph that may move to the engine thread with its backend.
struct OwnedGraph(CudaGraph);

// SAFETY: driver handles are not tied to the thread that made them; cudarc binds the context
// to the calling thread before every graph call, and the graphs sit behind the backend's mutex,
// so one thread uses a graph at a time.
unsafe impl Send for OwnedGraph {}

#[derive(Default)]
pub(super) struct Graphs {
    by_key: HashMap<GraphKey, CapturedForward>,
    /// Forwards seen per key not captured yet.
    seen: HashMap<GraphKey, u32>,
    /// Where every graph leaves output `i` (see the module comment).
    outputs: Vec<CudaSlice<f32>>,
}

impl Graphs {
    pub fn clear(&mut self) {
        self.by_key.clear();
        self.seen.clear();
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }
}

impl CudaBackend {
    /// Copies of the first `real` rows of a graph's outputs out of the shared buffers.
    fn read_graph_outputs(&self, buffers: &[CudaSlice<f32>], shapes: &[(usize, usize)], real: Real) -> Vec<CudaTensor> {
        shapes
            .iter()
            .zip(buffers)
            .map(|(&(rows, cols), buf)| {
                assert!(real.0 <= rows, "a graph output of {rows} rows cannot hold {} real rows", real.0);
                let mut out = self.tensor(real.0, cols);
                if real.0 > 0 {
                    ck(self.stream.memcpy_dtod(&buf.slice(0..real.0 * cols), &mut out.data), "graph output copy");
                }
                out
            })
            .collect()
    }

    /// The first `real` rows of eager outputs.
    fn cut_outputs(&self, outputs: Vec<CudaTensor>, real: Real) -> Vec<CudaTensor> {
        outputs.into_iter().map(|t| if t.rows == real.0 { t } else { self.first_rows(&t, real) }).collect()
    }

    /// Writes a graphed forward's inputs to the persistent buffers its kernels read.
    fn write_graph_inputs(&self, inputs: &GraphInputs<'_>) {
        let mut step = self.step_inputs();
        let ids: Vec<i32> = inputs.ids.iter().map(|&i| i as i32).collect();
        step.ids.write(self, &ids);
        step.layout(self, inputs.layout, inputs.block_size);
        let rows: Vec<i32> = inputs.logit_rows.iter().map(|&r| r as i32).collect();
        step.gather.write(self, &rows);
    }

    pub(super) fn run_graphed_forward(&self, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        // Per-op timing records events between launches; it measures the plain launches.
        if self.profiler.enabled {
            return self.cut_outputs(forward(), inputs.real.tokens);
        }
        let key = inputs.key();
        self.write_graph_inputs(inputs);
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        if !graphs.by_key.contains_key(&key) {
            let seen = graphs.seen.entry(key).or_insert(0);
            *seen += 1;
            let wait = *seen < if inputs.capture == CaptureWhen::Now { 2 } else { CAPTURE_AFTER };
            if wait || graphs.by_key.len() >= MAX_GRAPHS {
                drop(graphs);
                return self.cut_outputs(forward(), inputs.real.tokens);
            }
            self.capture(&mut graphs, key, forward);
        }
        let captured = &graphs.by_key[&key];
        // Capturing ran nothing: a launch computes the step.
        ck(captured.graph.0.launch(), "graph launch");
        self.read_graph_outputs(&graphs.outputs, &captured.shapes, inputs.real.tokens)
    }

    /// Captures (and runs once) the graph of a step of padded rows only, ahead of the steps
    /// that will replay it.
    pub(super) fn prepare_graphed_forward(&self, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Result<bool, BackendError> {
        if self.profiler.enabled {
            return Ok(false);
        }
        if inputs.real.rows.0 != 0 {
            return Err(BackendError::Invalid("a graph prepared ahead of its steps must have padded rows only".into()));
        }
        let key = inputs.key();
        self.write_graph_inputs(inputs);
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        if !graphs.by_key.contains_key(&key) {
            if graphs.by_key.len() >= MAX_GRAPHS {
                return Ok(false);
            }
            self.capture(&mut graphs, key, forward);
        }
        // The first launch maps the graph's activation memory: pay for it now.
        ck(graphs.by_key[&key].graph.0.launch(), "graph launch");
        ck(self.stream.synchronize(), "graph warm-up");
        Ok(true)
    }

    /// Captures `forward` as the graph of `key`.
    fn capture(&self, graphs: &mut Graphs, key: GraphKey, forward: &mut dyn FnMut() -> Vec<CudaTensor>) {
        // The second attempt fits: the first grows the shared output buffers when they are small.
        for _ in 0..2 {
            ck(self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "begin graph capture");
            self.capturing.store(true, Ordering::Relaxed);
            let buffers = &mut graphs.outputs;
            // A panic inside the capture (an op refusing its input) must still end it.
            let captured = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let outputs = forward();
                let shapes: Vec<(usize, usize)> = outputs.iter().map(|t| (t.rows, t.cols)).collect();
                let fits = buffers.len() >= outputs.len() && outputs.iter().zip(buffers.iter()).all(|(t, b)| b.len() >= t.rows * t.cols);
                if fits {
                    for (t, buf) in outputs.iter().zip(buffers.iter_mut()) {
                        ck(self.stream.memcpy_dtod(&t.data, &mut buf.slice_mut(0..t.rows * t.cols)), "graph output copy");
                    }
                }
                // Dropped inside the capture: the graph frees every allocation it makes.
                drop(outputs);
                (shapes, fits)
            }));
            self.capturing.store(false, Ordering::Relaxed);
            let graph = self.stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
            let (shapes, fits) = match captured {
                Ok(c) => c,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            let graph = ck(graph, "end graph capture").expect("a captured forward has kernels");
            if !fits {
                drop(graph);
                // Existing graphs write to the old buffers.
                graphs.clear();
                // Doubling: a workload whose steps keep growing regrows (and recaptures) rarely.
                let old: Vec<usize> = graphs.outputs.iter().map(|b| b.len()).collect();
                graphs.outputs = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, &(r, c))| ck(self.stream.alloc_zeros::<f32>((r * c).max(2 * old.get(i).copied().unwrap_or(0)).max(1)), "graph output buffer"))
                    .collect();
                continue;
            }
            graphs.by_key.insert(key, CapturedForward { shapes, graph: OwnedGraph(graph) });
            graphs.seen.remove(&key);
            return;
        }
        unreachable!("the shared output buffers fit after growing")
    }

    /// Graphs captured so far (for tests and reports).
    pub fn captured_graphs(&self) -> usize {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Drops every captured graph (their kernels hold addresses of the old cache).
    pub(super) fn drop_graphs(&self) {
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

//! CUDA graphs of whole decode forwards (DESIGN Invariant 4).
//!
//! A forward of generate rows only (decodes and verify rows, every token sampled) launches the
//! same kernels with the same arguments for a given row and token count: its per-step inputs
//! (ids, the packed layout, the logits rows) sit in persistent buffers at fixed addresses, with
//! offsets that depend only on those counts (see layout.rs), and every grid size is a function
//! of the shapes. So the first such forward of each key is captured, and later steps write
//! their inputs into those buffers and replay it. A key is captured on its
//! [`CAPTURE_AFTER`]th forward: a capture costs a few eager forwards, and with speculation many
//! (rows, tokens) keys occur only once or twice. Past [`MAX_GRAPHS`] keys, forwards run eagerly.
//!
//! Activations are allocated inside the graph (stream-ordered allocation nodes) and all of
//! them are freed inside it too: the outputs are first copied into buffers shared by every
//! graph (graphs run one at a time and each step copies its outputs out at once), so graphs
//! can share their activation memory. A new cache (other KV and state addresses) drops every
//! graph, and so does growing the shared output buffers.

use super::{ck, CudaBackend, CudaTensor};
use cudarc::driver::CudaSlice;
use crate::backend::{GraphInputs, GraphKey};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Most graphs kept: every row count with every verify-row length of a busy engine.
const MAX_GRAPHS: usize = 256;

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
    /// Copies of a graph's outputs out of the shared buffers.
    fn read_graph_outputs(&self, buffers: &[CudaSlice<f32>], shapes: &[(usize, usize)]) -> Vec<CudaTensor> {
        shapes
            .iter()
            .zip(buffers)
            .map(|(&(rows, cols), buf)| {
                let mut out = self.tensor(rows, cols);
                ck(self.stream.memcpy_dtod(&buf.slice(0..rows * cols), &mut out.data), "graph output copy");
                out
            })
            .collect()
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

    pub(super) fn run_graphed_forward(&self, key: GraphKey, inputs: &GraphInputs<'_>, forward: &mut dyn FnMut() -> Vec<CudaTensor>) -> Vec<CudaTensor> {
        // Per-op timing records events between launches; it measures the plain launches.
        if self.profiler.enabled {
            return forward();
        }
        self.write_graph_inputs(inputs);
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(captured) = graphs.by_key.get(&key) {
            ck(captured.graph.0.launch(), "graph launch");
            return self.read_graph_outputs(&graphs.outputs, &captured.shapes);
        }
        let seen = graphs.seen.entry(key).or_insert(0);
        *seen += 1;
        if *seen < CAPTURE_AFTER || graphs.by_key.len() >= MAX_GRAPHS {
            return forward();
        }
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
            // Capturing ran nothing: this launch computes the step.
            ck(graph.launch(), "graph launch");
            let outputs = self.read_graph_outputs(&graphs.outputs, &shapes);
            graphs.by_key.insert(key, CapturedForward { shapes, graph: OwnedGraph(graph) });
            graphs.seen.remove(&key);
            return outputs;
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

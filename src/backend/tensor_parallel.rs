//! The reduction rule that keeps a row-parallel layer over N GPUs bitwise equal to one GPU
//! (DESIGN Invariant 5).
//!
//! Every matmul kernel reduces K the same way, whichever kernel a row count picks: K is cut into
//! [`K_SLICES`] fixed slices that depend on K alone, each slice's sum starts at zero and walks its
//! units in order, and the slice sums are added in slice order, `0 + s0 + s1 + ... + s7`:
//! - bf16/f32 weights (cuda/matmul.cu: the few-row body, the tiled and pipelined kernels;
//!   cuda/matmul_tiles.cu: the warp-tile kernels and the cluster kernel `matmul_sliced`;
//!   cuda/matmul_stream.cu; the MoE kernels of cuda/moe_stream.cu): 32-wide k blocks,
//!   `ceil(blocks / 8)` blocks per slice;
//! - quantized weights (cuda/qmatmul.cu: few-row, many-row and the split launch that stores
//!   slice sums to memory): units of the format's `QU` (32, or 128 for the k-quants and
//!   IQ4_XS), `ceil(units / 8)` units per slice.
//!
//! So when K is 8 equal slices of whole units and N divides 8, GPU r's columns of a row-parallel
//! weight are exactly the slices `r * 8/N .. (r + 1) * 8/N`, and its kernel computes those slice
//! sums bitwise as one GPU does. What it must not do is add them up from zero and hand the total
//! to an all-reduce: `(s0 + s1 + s2 + s3) + (s4 + s5 + s6 + s7)` is not `0 + s0 + ... + s7` in
//! floating point, and NCCL's all-reduce picks its summation order (ring, tree, NVLS) by message
//! size and topology. The rule: every GPU gathers the 8 slice sums of each output element and adds
//! them from zero in slice order ([`add_slices_in_order`]), then adds the result to the residual
//! stream as the one-GPU `matmul_add` does. Two ways to move them, whose cost
//! tests/cuda_tensor_parallel.rs measures against `ncclAllReduce`:
//! - all-gather of the slice sums (8 values per output element reach every GPU: 8/N times the
//!   bytes each GPU sends, one collective);
//! - a chain: GPU 0 adds its slices from zero and sends the running sum to GPU 1, which adds its
//!   slices in order and passes it on; the last GPU broadcasts the total (the bytes of an
//!   all-reduce, N - 1 + 1 sequential steps).
//!
//! What the runtime's kernels must still do (tests/cuda_tensor_parallel.rs computes each slice
//! sum with the full weight and the other columns of the activations zeroed, which gives the
//! same bits): a GPU holding K/N columns cannot run the ordinary kernel on them, which would cut
//! K/N into 8 slices of its own. Its launch must take the slice width of the full K and compute
//! only its 8/N slices, storing each slice's sums (the quantized split launch already stores
//! slice sums to memory) for the gather, or adding them from zero (GPU 0) or from the running
//! sum it received (the chain).

/// Fixed slices the matmul kernels cut K into (cuda/matmul_common.cuh `KSLICES`).
pub const K_SLICES: usize = 8;

/// The one-GPU sum of slice partials: `parts[s][i]` is slice s's sum for output element i, in
/// slice order; each element is `0 + parts[0][i] + parts[1][i] + ...`, added left to right.
pub fn add_slices_in_order(parts: &[&[f32]]) -> Vec<f32> {
    let len = parts.first().map_or(0, |p| p.len());
    assert!(parts.iter().all(|p| p.len() == len), "slice partials of different lengths");
    (0..len).map(|i| parts.iter().fold(0.0f32, |sum, p| sum + p[i])).collect()
}

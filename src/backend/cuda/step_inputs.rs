//! Per-step inputs — token ids, the packed batch layout, row and column indices of gathers —
//! in device buffers allocated once at their largest size and overwritten in place (DESIGN
//! Invariant 4), so kernels always read them at the same addresses.
//!
//! Overwriting is safe because all work runs on the backend's one stream: the copy of the next
//! contents is queued after every kernel that reads the current ones.

use super::layout::{self, DeviceLayout};
use super::{ck, CudaBackend};
use crate::backend::{BackendError, BatchLayout, StepLimits};
use cudarc::driver::CudaSlice;

/// One device buffer of i32 that keeps its allocation between steps.
#[derive(Default)]
pub(super) struct PersistentInts {
    buf: Option<CudaSlice<i32>>,
    /// What the buffer holds now: a write of the same contents copies nothing (so an op inside
    /// a graph capture finds its inputs already in place).
    held: Vec<i32>,
}

impl PersistentInts {
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// Makes room for `n` ints (a new allocation only when it grows).
    pub fn reserve(&mut self, be: &CudaBackend, n: usize) -> Result<(), BackendError> {
        if n > self.capacity() {
            assert!(!be.capturing(), "a step input buffer would grow inside a graph capture");
            // SAFETY: only the part written by `write` is ever read.
            let buf = unsafe { be.stream.alloc::<i32>(n.max(1)) }.map_err(|e| BackendError::OutOfMemory(format!("step input buffer of {n} ints: {e:?}")))?;
            self.buf = Some(buf);
            self.held.clear();
        }
        Ok(())
    }

    /// Copies `data` to the start of the buffer and returns its device address.
    pub fn write(&mut self, be: &CudaBackend, data: &[i32]) -> u64 {
        if let Err(e) = self.reserve(be, data.len()) {
            panic!("{e}");
        }
        let buf = self.buf.as_mut().expect("reserved above");
        if !data.is_empty() && self.held != data {
            // A capture records launches only: inputs must be written before it starts.
            assert!(!be.capturing(), "a step input changed inside a graph capture (the graph key misses a host decision)");
            let mut dst = buf.slice_mut(0..data.len());
            ck(be.stream.memcpy_htod(data, &mut dst), "step input copy");
            self.held.clear();
            self.held.extend_from_slice(data);
        }
        be.ptr(buf)
    }
}

impl PersistentInts {
    /// Forgets what the buffer holds after a kernel wrote it (a drafter chain's ids): the next
    /// write copies whatever it is given.
    pub fn forget(&mut self) {
        self.held.clear();
    }
}

/// The persistent inputs of the steps run so far.
#[derive(Default)]
pub(super) struct StepInputs {
    pub ids: PersistentInts,
    pub layout: PersistentInts,
    pub gather: PersistentInts,
}

impl StepInputs {
    /// Allocates every buffer for the largest step of `limits`.
    pub fn reserve(&mut self, be: &CudaBackend, limits: StepLimits) -> Result<(), BackendError> {
        let (t, r) = (limits.max_tokens, limits.max_rows);
        self.ids.reserve(be, t)?;
        // Row records, token rows and positions, block tables, prefill and generate row lists.
        self.layout.reserve(be, r * layout::ROW_INTS + 2 * t + r * limits.max_blocks_per_row + 2 * r)?;
        self.gather.reserve(be, t)?;
        Ok(())
    }

    /// `layout` in the layout buffer (copied only when it differs from what the buffer holds,
    /// so every layer of a step reuses one copy).
    pub fn layout(&mut self, be: &CudaBackend, layout: &BatchLayout, block_size: usize) -> DeviceLayout {
        let packed = layout::pack(layout, block_size);
        let base = self.layout.write(be, &packed.ints);
        DeviceLayout {
            base,
            num_tokens: packed.num_tokens,
            tok_row_off: packed.tok_row_off,
            pos_off: packed.pos_off,
            prefill_off: packed.prefill_off,
            num_prefill: packed.num_prefill,
            generate_off: packed.generate_off,
            num_generate: packed.num_generate,
            max_block: packed.max_block,
            max_state_slot: packed.max_state_slot,
            max_snapshot: packed.max_snapshot,
        }
    }
}

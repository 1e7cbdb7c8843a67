//! Attention KV blocks and recurrent-state slots on the device, in the CPU backend's layouts:
//! per attention layer K and V `[num_blocks * block_size, kv_heads * head_dim]`; per linear
//! layer conv windows `[slots, (K-1) * conv_dim]` (oldest input first) and delta-rule states
//! `[slots, nv, dk, dv]`, each with a snapshot array of the same shape per snapshot slot.

use super::{ck, CudaBackend};
use crate::backend::{BackendError, CacheSpec};
use cudarc::driver::CudaSlice;

pub struct CudaCache {
    pub spec: CacheSpec,
    pub(super) k: Vec<CudaSlice<f32>>,
    pub(super) v: Vec<CudaSlice<f32>>,
    pub(super) conv: Vec<CudaSlice<f32>>,
    pub(super) rec: Vec<CudaSlice<f32>>,
    pub(super) conv_snap: Vec<CudaSlice<f32>>,
    pub(super) rec_snap: Vec<CudaSlice<f32>>,
}

/// Largest key/value head dims and conv history the kernels hold in registers.
pub(super) const MAX_HEAD_DIM_LINEAR: usize = 128;
pub(super) const MAX_CONV_HISTORY: usize = 8;

pub(super) fn alloc(be: &CudaBackend, spec: &CacheSpec) -> Result<CudaCache, BackendError> {
    let l = &spec.linear;
    if spec.linear_layers > 0 {
        if l.key_head_dim > MAX_HEAD_DIM_LINEAR || l.value_head_dim > MAX_HEAD_DIM_LINEAR {
            return Err(BackendError::Invalid(format!("linear-attention head dims {}x{} exceed the CUDA kernels' limit of {MAX_HEAD_DIM_LINEAR}", l.key_head_dim, l.value_head_dim)));
        }
        if l.conv_kernel < 1 || l.conv_kernel - 1 > MAX_CONV_HISTORY {
            return Err(BackendError::Invalid(format!("conv kernel {} is outside 1..={}", l.conv_kernel, MAX_CONV_HISTORY + 1)));
        }
    }
    let zeros = |n: usize, layers: usize| -> Result<Vec<CudaSlice<f32>>, BackendError> {
        (0..layers).map(|_| be.stream.alloc_zeros::<f32>(n.max(1)).map_err(|e| BackendError::OutOfMemory(format!("{} MiB for the cache: {e:?}", (n * 4) >> 20)))).collect()
    };
    let kv = spec.num_blocks * spec.block_size * spec.kv_heads * spec.head_dim;
    let (conv, rec) = (l.conv_state_len(), l.recurrent_state_len());
    Ok(CudaCache {
        k: zeros(kv, spec.attention_layers)?,
        v: zeros(kv, spec.attention_layers)?,
        conv: zeros(spec.state_slots * conv, spec.linear_layers)?,
        rec: zeros(spec.state_slots * rec, spec.linear_layers)?,
        conv_snap: zeros(spec.snapshot_slots * conv, spec.linear_layers)?,
        rec_snap: zeros(spec.snapshot_slots * rec, spec.linear_layers)?,
        spec: spec.clone(),
    })
}

pub(super) fn commit(be: &CudaBackend, cache: &mut CudaCache, slot: usize, snapshot: usize) {
    assert!(slot < cache.spec.state_slots && snapshot < cache.spec.snapshot_slots, "commit_state: slot {slot} / snapshot {snapshot} out of range");
    let (conv, rec) = (cache.spec.linear.conv_state_len(), cache.spec.linear.recurrent_state_len());
    for layer in 0..cache.spec.linear_layers {
        let src = cache.conv_snap[layer].slice(snapshot * conv..(snapshot + 1) * conv);
        let mut dst = cache.conv[layer].slice_mut(slot * conv..(slot + 1) * conv);
        ck(be.stream.memcpy_dtod(&src, &mut dst), "commit_state");
        let src = cache.rec_snap[layer].slice(snapshot * rec..(snapshot + 1) * rec);
        let mut dst = cache.rec[layer].slice_mut(slot * rec..(slot + 1) * rec);
        ck(be.stream.memcpy_dtod(&src, &mut dst), "commit_state");
    }
}

pub(super) fn reset(be: &CudaBackend, cache: &mut CudaCache, slot: usize) {
    assert!(slot < cache.spec.state_slots, "reset_state: slot {slot} out of range");
    let (conv, rec) = (cache.spec.linear.conv_state_len(), cache.spec.linear.recurrent_state_len());
    for layer in 0..cache.spec.linear_layers {
        ck(be.stream.memset_zeros(&mut cache.conv[layer].slice_mut(slot * conv..(slot + 1) * conv)), "reset_state");
        ck(be.stream.memset_zeros(&mut cache.rec[layer].slice_mut(slot * rec..(slot + 1) * rec)), "reset_state");
    }
}

impl CudaBackend {
    /// A host copy of the cache in the CPU backend's layout (for comparisons and debugging).
    pub fn cache_to_host(&self, cache: &CudaCache) -> crate::backend::cpu::CpuCache {
        let host = |v: &Vec<CudaSlice<f32>>, n: usize| -> Vec<Vec<f32>> {
            v.iter()
                .map(|s| {
                    let mut h = ck(self.stream.clone_dtoh(s), "device to host copy");
                    h.truncate(n);
                    h
                })
                .collect()
        };
        let s = &cache.spec;
        let kv = s.num_blocks * s.block_size * s.kv_heads * s.head_dim;
        let (conv, rec) = (s.linear.conv_state_len(), s.linear.recurrent_state_len());
        crate::backend::cpu::CpuCache {
            spec: s.clone(),
            k: host(&cache.k, kv),
            v: host(&cache.v, kv),
            conv: host(&cache.conv, s.state_slots * conv),
            rec: host(&cache.rec, s.state_slots * rec),
            conv_snap: host(&cache.conv_snap, s.snapshot_slots * conv),
            rec_snap: host(&cache.rec_snap, s.snapshot_slots * rec),
        }
    }
}

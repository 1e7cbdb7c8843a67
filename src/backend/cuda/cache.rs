//! Attention KV blocks and recurrent-state slots on the device, in the CPU backend's layouts:
//! per attention layer K and V each a data plane `[slot][kv_head][data bytes]` and a parameter
//! plane `[slot][kv_head][params]` in the cache's KV format (backend/cpu/kv_store.rs); per
//! linear layer conv windows `[slots, (K-1) * conv_dim]` (oldest input first) and delta-rule states
//! `[slots, nv, dk * dv]`, each with a snapshot array of the same shape per snapshot slot and
//! a checkpoint array per prefix-cache checkpoint. A head's `dk * dv` state elements are in
//! the decode kernel's thread order ([`recurrent_state_index`]) rather than the CPU's row order.

use super::{ck, Arg, CudaBackend};
use crate::backend::cpu::kv_store::{KvPlanes, KvStore};
use crate::backend::{BackendError, CacheSpec, StateCheckpoint, StateCommit};
use cudarc::driver::CudaSlice;
use kestrel_quant::kv::VectorFormat;

/// One attention layer's K or V on the device.
pub(super) struct DevicePlanes {
    pub data: CudaSlice<u8>,
    pub params: CudaSlice<u16>,
}

pub struct CudaCache {
    pub spec: CacheSpec,
    /// Per attention layer.
    pub(super) k: Vec<DevicePlanes>,
    pub(super) v: Vec<DevicePlanes>,
    /// What the kernels of a rotated KV format read: the codebook and the rotation
    /// (attention::kv_tables).
    pub(super) kv_tables: CudaSlice<f32>,
    pub(super) conv: Vec<CudaSlice<f32>>,
    pub(super) rec: Vec<CudaSlice<f32>>,
    pub(super) conv_snap: Vec<CudaSlice<f32>>,
    pub(super) rec_snap: Vec<CudaSlice<f32>>,
    pub(super) conv_ckpt: Vec<CudaSlice<f32>>,
    pub(super) rec_ckpt: Vec<CudaSlice<f32>>,
    /// Base addresses of the per-layer buffers above, for the kernels that commit and reset
    /// the state of every layer in one launch.
    tables: StateTables,
}

struct StateTables {
    conv: CudaSlice<u64>,
    rec: CudaSlice<u64>,
    conv_snap: CudaSlice<u64>,
    rec_snap: CudaSlice<u64>,
    conv_ckpt: CudaSlice<u64>,
    rec_ckpt: CudaSlice<u64>,
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
    let vectors = spec.num_blocks * spec.block_size * spec.kv_heads;
    let planes = |format: VectorFormat| -> Result<Vec<DevicePlanes>, BackendError> {
        let oom = |n: usize| move |e| BackendError::OutOfMemory(format!("{} MiB for the KV cache: {e:?}", n >> 20));
        let (data, params) = (vectors * format.data_bytes(spec.head_dim), vectors * format.params());
        (0..spec.attention_layers)
            .map(|_| Ok(DevicePlanes { data: be.stream.alloc_zeros::<u8>(data.max(1)).map_err(oom(data))?, params: be.stream.alloc_zeros::<u16>(params.max(1)).map_err(oom(2 * params))? }))
            .collect()
    };
    let kv_tables = super::attention::kv_tables(be, spec)?;
    let (k, v) = (planes(spec.kv_dtype.key_format())?, planes(spec.kv_dtype.value_format())?);
    let conv_len = |s: &CacheSpec| s.linear.conv_state_len();
    let rec_len = |s: &CacheSpec| s.linear.recurrent_state_len();
    let (conv, rec) = (zeros(spec.state_slots * conv_len(spec), spec.linear_layers)?, zeros(spec.state_slots * rec_len(spec), spec.linear_layers)?);
    let (conv_snap, rec_snap) = (zeros(spec.snapshot_slots * conv_len(spec), spec.linear_layers)?, zeros(spec.snapshot_slots * rec_len(spec), spec.linear_layers)?);
    let (conv_ckpt, rec_ckpt) = (zeros(spec.checkpoint_slots * conv_len(spec), spec.linear_layers)?, zeros(spec.checkpoint_slots * rec_len(spec), spec.linear_layers)?);
    let table = |v: &Vec<CudaSlice<f32>>| -> Result<CudaSlice<u64>, BackendError> {
        let ptrs: Vec<u64> = v.iter().map(|s| be.ptr(s)).collect();
        let ptrs = if ptrs.is_empty() { vec![0] } else { ptrs };
        be.stream.clone_htod(&ptrs).map_err(|e| BackendError::Device(format!("{e:?}")))
    };
    let tables = StateTables {
        conv: table(&conv)?,
        rec: table(&rec)?,
        conv_snap: table(&conv_snap)?,
        rec_snap: table(&rec_snap)?,
        conv_ckpt: table(&conv_ckpt)?,
        rec_ckpt: table(&rec_ckpt)?,
    };
    Ok(CudaCache { k, v, kv_tables, conv, rec, conv_snap, rec_snap, conv_ckpt, rec_ckpt, tables, spec: spec.clone() })
}

/// Threads and delta-rule chunks per (request, layer) of the state kernels (cuda/gdn.cu).
const STATE_THREADS: u32 = 256;
const STATE_CHUNKS: u32 = 16;

pub(super) fn commit(be: &CudaBackend, cache: &mut CudaCache, commits: &[StateCommit]) {
    let mut list = Vec::with_capacity(3 * commits.len());
    for c in commits {
        assert!(c.slot < cache.spec.state_slots && c.snapshot < cache.spec.snapshot_slots, "commit_states: slot {} / snapshot {} out of range", c.slot, c.snapshot);
        list.extend([c.slot as i32, c.snapshot as i32, i32::from(c.conv_only)]);
    }
    let t = &cache.tables;
    launch_per_request(be, cache, &be.k.commit_states, &list, commits.len(), &[be.ptr(&t.conv), be.ptr(&t.rec), be.ptr(&t.conv_snap), be.ptr(&t.rec_snap)]);
}

/// Canonical states to checkpoints. The checkpoint copies use the commit kernel, which copies
/// whole states from one table of layers to another: here from the canonical slots to the
/// checkpoints, and back for a restore.
pub(super) fn save_checkpoints(be: &CudaBackend, cache: &mut CudaCache, copies: &[StateCheckpoint]) {
    let mut list = Vec::with_capacity(3 * copies.len());
    for c in copies {
        assert!(c.slot < cache.spec.state_slots && c.checkpoint < cache.spec.checkpoint_slots, "save_checkpoints: slot {} / checkpoint {} out of range", c.slot, c.checkpoint);
        list.extend([c.checkpoint as i32, c.slot as i32, 0]);
    }
    let t = &cache.tables;
    launch_per_request(be, cache, &be.k.commit_states, &list, copies.len(), &[be.ptr(&t.conv_ckpt), be.ptr(&t.rec_ckpt), be.ptr(&t.conv), be.ptr(&t.rec)]);
}

/// Checkpoints to canonical states (the commit kernel, as above).
pub(super) fn restore_checkpoints(be: &CudaBackend, cache: &mut CudaCache, copies: &[StateCheckpoint]) {
    let mut list = Vec::with_capacity(3 * copies.len());
    for c in copies {
        assert!(c.slot < cache.spec.state_slots && c.checkpoint < cache.spec.checkpoint_slots, "restore_checkpoints: slot {} / checkpoint {} out of range", c.slot, c.checkpoint);
        list.extend([c.slot as i32, c.checkpoint as i32, 0]);
    }
    let t = &cache.tables;
    launch_per_request(be, cache, &be.k.commit_states, &list, copies.len(), &[be.ptr(&t.conv), be.ptr(&t.rec), be.ptr(&t.conv_ckpt), be.ptr(&t.rec_ckpt)]);
}

pub(super) fn reset(be: &CudaBackend, cache: &mut CudaCache, slots: &[usize]) {
    for &s in slots {
        assert!(s < cache.spec.state_slots, "reset_states: slot {s} out of range");
    }
    let list: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
    let t = &cache.tables;
    launch_per_request(be, cache, &be.k.reset_states, &list, slots.len(), &[be.ptr(&t.conv), be.ptr(&t.rec)]);
}

/// One launch of a state kernel over `requests` requests and every linear layer: its
/// arguments are the layer tables, the request list and the conv / delta-rule state lengths.
fn launch_per_request(be: &CudaBackend, cache: &CudaCache, f: &cudarc::driver::CudaFunction, list: &[i32], requests: usize, tables: &[u64]) {
    if requests == 0 || cache.spec.linear_layers == 0 {
        return;
    }
    let list = ck(be.stream.clone_htod(list), "state request list copy");
    let (conv, rec) = (cache.spec.linear.conv_state_len(), cache.spec.linear.recurrent_state_len());
    let mut args: Vec<Arg> = tables.iter().map(|&p| Arg::Ptr(p)).collect();
    args.extend([Arg::Ptr(be.ptr(&list)), Arg::I64(conv as i64), Arg::I64(rec as i64)]);
    be.launch(f, (requests as u32, cache.spec.linear_layers as u32, STATE_CHUNKS), STATE_THREADS, 0, &args);
}

/// Where element (i, j) of a head's `dk x dv` delta-rule state sits among its `dk * dv` floats
/// on the device: state_index in cuda/gdn.cu. With dk a multiple of 16, thread (column j, group
/// r) of the decode kernel holds rows `r * dk/4 + m` in registers, its rows `4a .. 4a + 3` are
/// one float4, and float4 a of all its threads is one run, thread after thread, so that each
/// warp's store of the state is one contiguous run. Otherwise row by row.
pub fn recurrent_state_index(i: usize, j: usize, dk: usize, dv: usize) -> usize {
    const GROUPS: usize = 4;
    if !dk.is_multiple_of(4 * GROUPS) {
        return i * dv + j;
    }
    let rows_per_group = dk / GROUPS;
    let m = i % rows_per_group;
    (((m / 4) * dv + j) * GROUPS + i / rows_per_group) * 4 + m % 4
}

/// Delta-rule states (whole heads of `dk * dv` floats) from the device's order into the CPU's.
fn recurrent_states_to_row_order(device: &[f32], dk: usize, dv: usize) -> Vec<f32> {
    let head = dk * dv;
    let mut host = vec![0.0; device.len()];
    for (d, h) in device.chunks_exact(head).zip(host.chunks_exact_mut(head)) {
        for i in 0..dk {
            for j in 0..dv {
                h[i * dv + j] = d[recurrent_state_index(i, j, dk, dv)];
            }
        }
    }
    host
}

/// Per checkpoint, every layer's conv window then delta-rule state (row order), as the CPU
/// cache keeps them.
fn checkpoints_in_cpu_layout(conv: &[Vec<f32>], rec: &[Vec<f32>], s: &CacheSpec) -> Vec<Vec<f32>> {
    let (conv_len, rec_len) = (s.linear.conv_state_len(), s.linear.recurrent_state_len());
    let (dk, dv) = (s.linear.key_head_dim, s.linear.value_head_dim);
    (0..s.checkpoint_slots)
        .map(|c| {
            let mut state = Vec::with_capacity(s.linear_layers * (conv_len + rec_len));
            for layer in 0..s.linear_layers {
                state.extend_from_slice(&conv[layer][c * conv_len..][..conv_len]);
                state.extend(recurrent_states_to_row_order(&rec[layer][c * rec_len..][..rec_len], dk, dv));
            }
            state
        })
        .collect()
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
        let mut kv = KvStore::new(s).expect("the device holds a cache of this format");
        let copy = |d: &DevicePlanes, h: &mut KvPlanes| {
            let (n, p) = (h.data.len(), h.params.len());
            h.data = ck(self.stream.clone_dtoh(&d.data), "device to host copy");
            h.data.truncate(n);
            h.params = ck(self.stream.clone_dtoh(&d.params), "device to host copy");
            h.params.truncate(p);
        };
        for (d, h) in cache.k.iter().zip(&mut kv.k).chain(cache.v.iter().zip(&mut kv.v)) {
            copy(d, h);
        }
        let (conv, rec) = (s.linear.conv_state_len(), s.linear.recurrent_state_len());
        let (dk, dv) = (s.linear.key_head_dim, s.linear.value_head_dim);
        crate::backend::cpu::CpuCache {
            spec: s.clone(),
            kv,
            conv: host(&cache.conv, s.state_slots * conv),
            rec: host(&cache.rec, s.state_slots * rec).iter().map(|r| recurrent_states_to_row_order(r, dk, dv)).collect(),
            conv_snap: host(&cache.conv_snap, s.snapshot_slots * conv),
            rec_snap: host(&cache.rec_snap, s.snapshot_slots * rec).iter().map(|r| recurrent_states_to_row_order(r, dk, dv)).collect(),
            checkpoints: checkpoints_in_cpu_layout(&host(&cache.conv_ckpt, s.checkpoint_slots * conv), &host(&cache.rec_ckpt, s.checkpoint_slots * rec), s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::recurrent_state_index;

    /// The device order is a permutation of each head's elements, and puts a decode warp's
    /// float4 a (columns j0 .. j0 + 7, groups 0 .. 3, rows 4a .. 4a + 3 of each group) in one
    /// run of 128 floats.
    #[test]
    fn recurrent_state_index_is_a_permutation_in_thread_order() {
        for (dk, dv) in [(128, 128), (32, 48), (16, 5), (8, 12), (6, 5), (3, 4)] {
            let mut seen = vec![false; dk * dv];
            for i in 0..dk {
                for j in 0..dv {
                    let at = recurrent_state_index(i, j, dk, dv);
                    assert!(at < dk * dv && !seen[at], "dk {dk} dv {dv}: ({i}, {j}) -> {at}");
                    seen[at] = true;
                }
            }
        }
        let (dk, dv) = (128, 128);
        let warp: Vec<usize> = (0..32 * 4).map(|e| recurrent_state_index(((e / 4) % 4) * dk / 4 + 8 + e % 4, 8 + e / 16, dk, dv)).collect();
        assert!(warp.windows(2).all(|w| w[1] == w[0] + 1), "{warp:?}");
        // dk not a multiple of 16: row order.
        assert_eq!(recurrent_state_index(2, 3, 8, 5), 13);
    }
}

//! The attention cache's keys and values in the cache's KV format (kestrel_quant::kv): per
//! attention layer, K and V each as a data plane `[slot][kv_head][data_bytes]` and a parameter
//! plane `[slot][kv_head][params]` of 16-bit values. The CUDA cache keeps the same planes, so a
//! device cache copies into this one byte for byte.

use crate::backend::{BackendError, CacheSpec};
use kestrel_quant::kv::{KvCodec, VectorFormat};

/// One layer's K or V: stored vectors and their parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPlanes {
    pub data: Vec<u8>,
    pub params: Vec<u16>,
}

/// Every attention layer's keys and values, and how to read and write them.
pub struct KvStore {
    pub key: KvCodec,
    pub value: KvCodec,
    pub kv_heads: usize,
    /// Per attention layer.
    pub k: Vec<KvPlanes>,
    pub v: Vec<KvPlanes>,
}

fn planes(format: VectorFormat, spec: &CacheSpec) -> Result<KvPlanes, BackendError> {
    let vectors = spec.num_blocks * spec.block_size * spec.kv_heads;
    let (data_len, params_len) = (vectors * format.data_bytes(spec.head_dim), vectors * format.params());
    let oom = || BackendError::OutOfMemory(format!("{} MiB for the KV cache", (data_len + 2 * params_len) >> 20));
    let mut data = Vec::new();
    data.try_reserve_exact(data_len).map_err(|_| oom())?;
    data.resize(data_len, 0);
    let mut params = Vec::new();
    params.try_reserve_exact(params_len).map_err(|_| oom())?;
    params.resize(params_len, 0);
    Ok(KvPlanes { data, params })
}

impl KvStore {
    pub fn new(spec: &CacheSpec) -> Result<KvStore, BackendError> {
        let dtype = spec.kv_dtype;
        dtype.check_head_dim(spec.head_dim).map_err(|e| BackendError::Invalid(format!("--kv-cache-dtype {dtype}: {e}")))?;
        let codec = |f| KvCodec::new(f, spec.head_dim).map_err(|e| BackendError::Invalid(format!("--kv-cache-dtype {dtype}: {e}")));
        let (key, value) = (codec(dtype.key_format())?, codec(dtype.value_format())?);
        let mut k = Vec::with_capacity(spec.attention_layers);
        let mut v = Vec::with_capacity(spec.attention_layers);
        for _ in 0..spec.attention_layers {
            k.push(planes(key.format(), spec)?);
            v.push(planes(value.format(), spec)?);
        }
        Ok(KvStore { key, value, kv_heads: spec.kv_heads, k, v })
    }

    /// Index of the vector of kv head `head` at cache slot `slot`.
    fn vector(&self, slot: usize, head: usize) -> usize {
        slot * self.kv_heads + head
    }

    fn write(codec: &KvCodec, planes: &mut KvPlanes, at: usize, x: &[f32]) {
        let (db, pc) = (codec.format().data_bytes(codec.dim()), codec.format().params());
        codec.encode(x, &mut planes.data[at * db..][..db], &mut planes.params[at * pc..][..pc]);
    }

    fn read(codec: &KvCodec, planes: &KvPlanes, at: usize, out: &mut [f32]) {
        let (db, pc) = (codec.format().data_bytes(codec.dim()), codec.format().params());
        codec.decode(&planes.data[at * db..][..db], &planes.params[at * pc..][..pc], out);
    }

    /// Stores the key of kv head `head` at `slot` of attention layer `layer`.
    pub fn write_key(&mut self, layer: usize, slot: usize, head: usize, x: &[f32]) {
        let at = self.vector(slot, head);
        Self::write(&self.key, &mut self.k[layer], at, x);
    }

    pub fn write_value(&mut self, layer: usize, slot: usize, head: usize, x: &[f32]) {
        let at = self.vector(slot, head);
        Self::write(&self.value, &mut self.v[layer], at, x);
    }

    /// The stored key, as attention reads it (rotated for a rotated format).
    pub fn read_key(&self, layer: usize, slot: usize, head: usize, out: &mut [f32]) {
        Self::read(&self.key, &self.k[layer], self.vector(slot, head), out);
    }

    pub fn read_value(&self, layer: usize, slot: usize, head: usize, out: &mut [f32]) {
        Self::read(&self.value, &self.v[layer], self.vector(slot, head), out);
    }

    /// Every stored key of a layer in the original space, `[slots, kv_heads * head_dim]` (for
    /// comparisons).
    pub fn keys(&self, layer: usize) -> Vec<f32> {
        Self::all(&self.key, &self.k[layer])
    }

    pub fn values(&self, layer: usize) -> Vec<f32> {
        Self::all(&self.value, &self.v[layer])
    }

    fn all(codec: &KvCodec, planes: &KvPlanes) -> Vec<f32> {
        let (d, db, pc) = (codec.dim(), codec.format().data_bytes(codec.dim()), codec.format().params());
        let n = planes.data.len() / db;
        let mut out = vec![0.0f32; n * d];
        for (i, o) in out.chunks_exact_mut(d).enumerate() {
            codec.decode_unrotated(&planes.data[i * db..][..db], &planes.params[i * pc..][..pc], o);
        }
        out
    }
}

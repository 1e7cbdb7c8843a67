//! safetensors files, single or sharded through `model.safetensors.index.json`.
//!
//! The header is parsed with the `safetensors` crate; the data stays in the memory map.

use super::{Dtype, IntEntry, SharedBytes, TensorEntry, WeightError, WeightStore};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

/// Opens every safetensors file of a model directory.
pub fn open_dir(dir: &Path) -> Result<WeightStore, WeightError> {
    let index = dir.join(INDEX_FILE);
    let files: Vec<PathBuf> = if index.exists() {
        shard_names(&index)?.into_iter().map(|n| dir.join(n)).collect()
    } else if dir.join(SINGLE_FILE).exists() {
        vec![dir.join(SINGLE_FILE)]
    } else {
        return Err(WeightError::NoWeights { path: dir.to_path_buf() });
    };
    let mut buffers = Vec::with_capacity(files.len());
    for path in files {
        let file = std::fs::File::open(&path).map_err(|source| WeightError::Open { path: path.clone(), source })?;
        // SAFETY: the map is read-only; a checkpoint modified while mapped is the user's error
        // (as with every mmap-based loader), not memory unsafety in our code paths.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| WeightError::Open { path: path.clone(), source })?;
        buffers.push((path, SharedBytes::from_mmap(map)));
    }
    from_buffers(buffers, dir.display().to_string())
}

/// Builds a store over already-loaded buffers (memory maps or embedded bytes).
pub fn from_buffers(files: Vec<(PathBuf, SharedBytes)>, description: String) -> Result<WeightStore, WeightError> {
    let mut tensors = HashMap::new();
    let mut ints = HashMap::new();
    for (file_idx, (path, bytes)) in files.iter().enumerate() {
        let buf = bytes.as_slice();
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(buf).map_err(|e| match e {
            safetensors::SafeTensorError::MetadataIncompleteBuffer => truncation_error(path, buf),
            other => WeightError::Malformed { path: path.clone(), reason: other.to_string() },
        })?;
        let data_start = 8 + header_len;
        let data_len = buf.len().saturating_sub(data_start);
        for (name, info) in meta.tensors() {
            let dtype = match info.dtype {
                safetensors::Dtype::F32 => Dtype::F32,
                safetensors::Dtype::F16 => Dtype::F16,
                safetensors::Dtype::BF16 => Dtype::BF16,
                safetensors::Dtype::F8_E4M3 => Dtype::F8E4M3,
                safetensors::Dtype::I32 => {
                    // Packed int4 values and zero points (and GPTQ's g_idx): read by the
                    // quantized linears, never as weights themselves.
                    let (start, end) = info.data_offsets;
                    let numel: usize = info.shape.iter().product();
                    if end > data_len {
                        return Err(WeightError::Truncated { path: path.clone(), tensor: name, end, len: data_len });
                    }
                    if end - start != 4 * numel {
                        return Err(WeightError::Malformed { path: path.clone(), reason: format!("tensor `{name}` has {} bytes for shape {:?}", end - start, info.shape) });
                    }
                    ints.insert(name, IntEntry { shape: info.shape.clone(), file: file_idx, start: data_start + start, end: data_start + end });
                    continue;
                }
                // Integer ids in reference files are not model weights.
                safetensors::Dtype::I64 => continue,
                other => return Err(WeightError::UnsupportedDtype { path: path.clone(), tensor: name, dtype: format!("{other:?}") }),
            };
            let (start, end) = info.data_offsets;
            if end > data_len {
                return Err(WeightError::Truncated { path: path.clone(), tensor: name, end, len: data_len });
            }
            let numel: usize = info.shape.iter().product();
            if dtype.row_bytes(numel).ok() != Some(end - start) {
                return Err(WeightError::Malformed { path: path.clone(), reason: format!("tensor `{name}` has {} bytes for shape {:?}", end - start, info.shape) });
            }
            tensors.insert(name, TensorEntry { dtype, shape: info.shape.clone(), file: file_idx, start: data_start + start, end: data_start + end });
        }
    }
    Ok(WeightStore::with_ints(files, tensors, ints, description))
}

/// Names the first tensor that a truncated file cuts off.
fn truncation_error(path: &Path, buf: &[u8]) -> WeightError {
    let malformed = || WeightError::Malformed { path: path.to_path_buf(), reason: "header does not match the file size".into() };
    let Some(len_bytes) = buf.get(..8) else { return malformed() };
    let header_len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
    let Some(header) = buf.get(8..8 + header_len) else { return malformed() };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(header) else { return malformed() };
    let data_len = buf.len() - 8 - header_len;
    let mut cut: Vec<(usize, String)> = map
        .iter()
        .filter_map(|(name, v)| {
            let end = v.get("data_offsets")?.get(1)?.as_u64()? as usize;
            (end > data_len).then(|| (end, name.clone()))
        })
        .collect();
    cut.sort();
    match cut.into_iter().next() {
        Some((end, tensor)) => WeightError::Truncated { path: path.to_path_buf(), tensor, end, len: data_len },
        None => malformed(),
    }
}

fn shard_names(index: &Path) -> Result<Vec<String>, WeightError> {
    let text = std::fs::read_to_string(index).map_err(|source| WeightError::Open { path: index.into(), source })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| WeightError::Index { path: index.into(), reason: e.to_string() })?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| WeightError::Index { path: index.into(), reason: "no `weight_map` object".into() })?;
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| WeightError::Index { path: index.into(), reason: format!("`{tensor}` maps to a non-string") })?;
        if file.contains('/') || file.contains("..") {
            return Err(WeightError::Index { path: index.into(), reason: format!("shard name `{file}` leaves the model directory") });
        }
        names.insert(file.to_string());
    }
    if names.is_empty() {
        return Err(WeightError::Index { path: index.into(), reason: "empty weight_map".into() });
    }
    Ok(names.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::{Dtype as StDtype, TensorView as StView};

    fn write_file(path: &Path, tensors: &[(&str, StDtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, StView)> = tensors.iter().map(|(n, d, s, b)| (n.to_string(), StView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_single_file_zero_copy() {
        let dir = tempfile::tempdir().unwrap();
        write_file(&dir.path().join(SINGLE_FILE), &[("model.norm.weight", StDtype::F32, vec![3], f32_bytes(&[1.0, 2.0, 3.0]))]);
        let store = open_dir(dir.path()).unwrap();
        let t = store.text("norm.weight").unwrap();
        assert_eq!(t.shape, &[3]);
        assert_eq!(t.to_f32().unwrap(), vec![1.0, 2.0, 3.0]);
        assert!(t.expect_shape(&[4]).is_err());
    }

    #[test]
    fn reads_sharded_with_index() {
        let dir = tempfile::tempdir().unwrap();
        write_file(&dir.path().join("a.safetensors"), &[("model.language_model.x", StDtype::F32, vec![1], f32_bytes(&[5.0]))]);
        write_file(&dir.path().join("b.safetensors"), &[("lm_head.weight", StDtype::F32, vec![1], f32_bytes(&[7.0]))]);
        std::fs::write(dir.path().join(INDEX_FILE), r#"{"weight_map":{"model.language_model.x":"a.safetensors","lm_head.weight":"b.safetensors"}}"#).unwrap();
        let store = open_dir(dir.path()).unwrap();
        assert_eq!(store.text("x").unwrap().to_f32().unwrap(), vec![5.0]);
        assert_eq!(store.get("lm_head.weight").unwrap().to_f32().unwrap(), vec![7.0]);
    }

    #[test]
    fn truncated_file_is_reported_with_tensor_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SINGLE_FILE);
        write_file(&path, &[("model.big", StDtype::F32, vec![64], f32_bytes(&[0.5; 64]))]);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 16]).unwrap();
        let err = open_dir(dir.path()).err().expect("truncated file must fail");
        let msg = err.to_string();
        assert!(msg.contains("model.safetensors") && (msg.contains("model.big") || msg.contains("not a valid")), "{msg}");
    }

    #[test]
    fn garbage_header_is_malformed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(SINGLE_FILE), b"\xff\xff\xff\xff\xff\xff\xff\x7fnot json").unwrap();
        assert!(matches!(open_dir(dir.path()), Err(WeightError::Malformed { .. })));
    }

    #[test]
    fn unsupported_dtype_is_named() {
        let dir = tempfile::tempdir().unwrap();
        write_file(&dir.path().join(SINGLE_FILE), &[("model.q", StDtype::U8, vec![4], vec![1, 2, 3, 4])]);
        let err = open_dir(dir.path()).err().unwrap();
        assert!(matches!(err, WeightError::UnsupportedDtype { .. }), "{err}");
        assert!(err.to_string().contains("model.q"));
    }

    #[test]
    fn missing_weights_and_missing_tensor() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(open_dir(dir.path()), Err(WeightError::NoWeights { .. })));
        write_file(&dir.path().join(SINGLE_FILE), &[("model.a", StDtype::F32, vec![1], f32_bytes(&[0.0]))]);
        let store = open_dir(dir.path()).unwrap();
        let err = store.text("layers.0.mlp.up_proj.weight").err().unwrap();
        assert!(err.to_string().contains("model.layers.0.mlp.up_proj.weight"), "{err}");
    }

    #[test]
    fn index_pointing_outside_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(INDEX_FILE), r#"{"weight_map":{"x":"../evil.safetensors"}}"#).unwrap();
        assert!(matches!(open_dir(dir.path()), Err(WeightError::Index { .. })));
    }
}

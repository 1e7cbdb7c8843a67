//! Value-head order of Qwen3.5 GGUF files, and putting it back.
//!
//! Hugging Face checkpoints group value heads by the key head they share
//! (`[k0v0, k0v1, .., k0v{r-1}, k1v0, ..]`, r = value heads per key head); the forward expects
//! that order. llama.cpp's converter (`_LinearAttentionVReorderBase._reorder_v_heads`, used by
//! `Qwen3_5TextModel` and `Qwen3_5MoeTextModel` when key and value head counts differ) stores
//! them tiled instead (`[k0v0, k1v0, .., k0v1, k1v1, ..]`) because ggml repeats the key heads
//! that way. It reorders the value rows of `in_proj_qkv`, the rows of `in_proj_z`,
//! `in_proj_a`, `in_proj_b`, the entries of `A_log` and `dt_bias`, the value channels of
//! `conv1d`, and the columns of `out_proj`. Qwen3-Next files keep the grouped order.
//!
//! Rows are whole runs of blocks in every ggml type, so reordering rows works for any type and
//! the loader puts them back. The columns of `out_proj` stay tiled: a quantized block (256
//! values in the K-quants) spans several 128-wide heads, so no reordering of blocks restores
//! them; the delta rule writes its output heads in the tiled order instead
//! (`LinearAttnShape::out_heads_tiled`).

/// Tiled-to-grouped head order for `num_key_heads` key heads with `per_key` value heads each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HeadOrder {
    pub num_key_heads: usize,
    pub per_key: usize,
}

impl HeadOrder {
    /// Nothing moves with one key head or one value head per key head.
    pub fn is_identity(self) -> bool {
        self.num_key_heads <= 1 || self.per_key <= 1
    }

    /// For each grouped head `g = k * per_key + v`, the tiled head it was stored as,
    /// `v * num_key_heads + k`.
    pub fn tiled_source(self) -> Vec<usize> {
        let (nk, r) = (self.num_key_heads, self.per_key);
        (0..nk * r).map(|g| (g % r) * nk + g / r).collect()
    }
}

/// Runs of `unit` elements of `src` gathered so that run `j` of the result is run `order[j]`
/// of `src` (a permutation when `order` covers every run once).
pub(super) fn permute_units<T: Copy>(src: &[T], unit: usize, order: &[usize]) -> Vec<T> {
    let mut out = Vec::with_capacity(src.len());
    for &from in order {
        out.extend_from_slice(&src[from * unit..(from + 1) * unit]);
    }
    out
}

/// `src` split into a fixed prefix of `keep` elements and `order.len()` heads of `head`
/// elements each; the heads are put in grouped order.
pub(super) fn untile_tail<T: Copy>(src: &[T], keep: usize, head: usize, order: &[usize]) -> Vec<T> {
    let mut out = src[..keep].to_vec();
    out.extend(permute_units(&src[keep..], head, order));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The converter's reorder, written from its description: grouped `[k][v]` to tiled `[v][k]`.
    fn tile(grouped: &[usize], nk: usize, r: usize) -> Vec<usize> {
        let mut out = vec![0; grouped.len()];
        for k in 0..nk {
            for v in 0..r {
                out[v * nk + k] = grouped[k * r + v];
            }
        }
        out
    }

    #[test]
    fn untiling_inverts_the_converter() {
        for (nk, r) in [(2, 3), (3, 2), (4, 4), (1, 5), (5, 1), (16, 2)] {
            let order = HeadOrder { num_key_heads: nk, per_key: r };
            let grouped: Vec<usize> = (0..nk * r).collect();
            let tiled = tile(&grouped, nk, r);
            assert_eq!(permute_units(&tiled, 1, &order.tiled_source()), grouped, "nk {nk} r {r}");
            assert_eq!(order.is_identity(), tiled == grouped, "nk {nk} r {r}");
        }
    }

    #[test]
    fn tails_move_whole_heads() {
        let order = HeadOrder { num_key_heads: 2, per_key: 2 }.tiled_source();
        assert_eq!(order, [0, 2, 1, 3]);
        // Two fixed elements, then four heads of two.
        let src = [9, 9, 0, 0, 2, 2, 1, 1, 3, 3];
        assert_eq!(untile_tail(&src, 2, 2, &order), [9, 9, 0, 0, 1, 1, 2, 2, 3, 3]);
    }
}

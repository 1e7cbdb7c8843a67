//! A step's [`BatchLayout`] packed into one device buffer of i32, shared by every layer of the
//! step (copied into the persistent layout buffer only when the layout changes).
//!
//! Packing: per row 8 ints (kind, token_start, num_tokens, start_position, state_slot,
//! snapshot_base, block_table_offset, block_table_len, as `RowInfo` in cuda/common.cuh), then
//! the row of every token, the position of every token, the block tables, the prefill row
//! ids and the generate row ids.

use crate::backend::{BatchLayout, RowKind};

pub(super) const ROW_INTS: usize = 8;

/// A packed layout in the persistent layout buffer (see step_inputs.rs).
#[derive(Clone)]
pub struct DeviceLayout {
    /// Device address of the packed ints.
    pub(super) base: u64,
    pub(super) num_tokens: usize,
    pub(super) tok_row_off: usize,
    pub(super) pos_off: usize,
    pub(super) prefill_off: usize,
    pub(super) num_prefill: usize,
    pub(super) generate_off: usize,
    pub(super) num_generate: usize,
    /// Highest block id, state slot and snapshot slot used (checked against the cache).
    pub(super) max_block: Option<u32>,
    pub(super) max_state_slot: Option<usize>,
    pub(super) max_snapshot: Option<usize>,
}

pub(super) struct PackedLayout {
    pub ints: Vec<i32>,
    pub num_tokens: usize,
    pub tok_row_off: usize,
    pub pos_off: usize,
    pub prefill_off: usize,
    pub num_prefill: usize,
    pub generate_off: usize,
    pub num_generate: usize,
    pub max_block: Option<u32>,
    pub max_state_slot: Option<usize>,
    pub max_snapshot: Option<usize>,
}

/// Packs a layout; panics with a message when rows overlap or leave tokens uncovered, as
/// the CPU backend would on the same input.
pub(super) fn pack(layout: &BatchLayout, block_size: usize) -> PackedLayout {
    let r = layout.rows.len();
    let t = layout.num_tokens();
    let tok_row_off = r * ROW_INTS;
    let pos_off = tok_row_off + t;
    let tables_off = pos_off + t;
    let mut ints = vec![0i32; tables_off];
    let mut tables = Vec::new();
    let mut covered = vec![false; t];
    let (mut prefill, mut generate) = (Vec::new(), Vec::new());
    let (mut max_block, mut max_state_slot, mut max_snapshot) = (None::<u32>, None::<usize>, None::<usize>);
    for (ri, row) in layout.rows.iter().enumerate() {
        let end = row.start_position + row.num_tokens;
        let need_blocks = end.div_ceil(block_size.max(1));
        assert!(row.block_table.len() >= need_blocks, "row {ri}: block table of {} blocks does not cover {end} positions", row.block_table.len());
        let info = [
            i32::from(row.kind == RowKind::Generate),
            row.token_start as i32,
            row.num_tokens as i32,
            row.start_position as i32,
            row.state_slot as i32,
            row.snapshot_base as i32,
            (tables_off + tables.len()) as i32,
            row.block_table.len() as i32,
        ];
        ints[ri * ROW_INTS..(ri + 1) * ROW_INTS].copy_from_slice(&info);
        for i in 0..row.num_tokens {
            let ti = row.token_start + i;
            assert!(ti < t && !covered[ti], "row {ri}: token {ti} is outside the step or in two rows");
            covered[ti] = true;
            ints[tok_row_off + ti] = ri as i32;
            ints[pos_off + ti] = (row.start_position + i) as i32;
        }
        tables.extend(row.block_table.iter().map(|&b| b as i32));
        max_block = row.block_table[..need_blocks].iter().copied().max().max(max_block);
        max_state_slot = max_state_slot.max(Some(row.state_slot));
        match row.kind {
            RowKind::Prefill => prefill.push(ri as i32),
            RowKind::Generate => {
                generate.push(ri as i32);
                if row.num_tokens > 0 {
                    max_snapshot = max_snapshot.max(Some(row.snapshot_base + row.num_tokens - 1));
                }
            }
        }
    }
    ints.extend_from_slice(&tables);
    let prefill_off = ints.len();
    ints.extend_from_slice(&prefill);
    let generate_off = ints.len();
    ints.extend_from_slice(&generate);
    PackedLayout {
        ints,
        num_tokens: t,
        tok_row_off,
        pos_off,
        prefill_off,
        num_prefill: prefill.len(),
        generate_off,
        num_generate: generate.len(),
        max_block,
        max_state_slot,
        max_snapshot,
    }
}

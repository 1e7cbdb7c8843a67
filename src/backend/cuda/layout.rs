//! A step's [`BatchLayout`] packed into one device buffer of i32, shared by every layer of the
//! step (copied into the persistent layout buffer only when the layout changes).
//!
//! Packing: per row 8 ints (kind, token_start, num_tokens, start_position, state_slot,
//! snapshot_base, block_table_offset, block_table_len, as `RowInfo` in cuda/common.cuh), then
//! the row of every token, the position of every token, the prefill row ids, the generate row
//! ids, and last the block tables.

use crate::backend::{BatchLayout, RowKind};

pub(super) const ROW_INTS: usize = 8;

/// A packed layout in the persistent layout buffer (see step_inputs.rs).
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
    // Row lists before the block tables: every offset depends only on the row and token
    // counts, never on how long the tables have grown (a captured graph keeps its offsets).
    let num_prefill = layout.rows.iter().filter(|row| row.kind == RowKind::Prefill).count();
    let prefill_off = pos_off + t;
    let generate_off = prefill_off + num_prefill;
    let tables_off = generate_off + (r - num_prefill);
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
    ints[prefill_off..generate_off].copy_from_slice(&prefill);
    ints[generate_off..tables_off].copy_from_slice(&generate);
    ints.extend_from_slice(&tables);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RowLayout;

    fn row(kind: RowKind, token_start: usize, num_tokens: usize, start_position: usize, blocks: usize) -> RowLayout {
        RowLayout { kind, token_start, num_tokens, start_position, block_table: (0..blocks as u32).collect(), state_slot: token_start, snapshot_base: token_start }
    }

    #[test]
    fn offsets_depend_on_the_counts_not_on_the_block_tables() {
        let short = BatchLayout { rows: vec![row(RowKind::Generate, 0, 1, 5, 1), row(RowKind::Prefill, 1, 2, 0, 1), row(RowKind::Generate, 3, 1, 9, 1)] };
        let long = BatchLayout { rows: vec![row(RowKind::Generate, 0, 1, 500, 40), row(RowKind::Prefill, 1, 2, 64, 9), row(RowKind::Generate, 3, 1, 900, 80)] };
        let (a, b) = (pack(&short, 16), pack(&long, 16));
        assert_eq!((a.tok_row_off, a.pos_off, a.prefill_off, a.generate_off), (b.tok_row_off, b.pos_off, b.prefill_off, b.generate_off));
        assert_eq!((a.num_prefill, a.num_generate), (1, 2));
        assert_eq!(&b.ints[b.prefill_off..b.prefill_off + 1], &[1]);
        assert_eq!(&b.ints[b.generate_off..b.generate_off + 2], &[0, 2]);
        // Row 1's table starts where row 0's (40 blocks) ends, after the row lists.
        let table_off = b.ints[ROW_INTS + 6] as usize;
        assert_eq!(table_off, b.generate_off + 2 + 40);
        assert_eq!(&b.ints[table_off..table_off + 9], &(0..9).collect::<Vec<i32>>()[..]);
        assert_eq!(b.ints.len(), table_off + 9 + 80);
    }
}

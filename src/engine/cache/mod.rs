//! Bookkeeping of the hybrid cache: paged KV blocks for the attention layers and one
//! recurrent-state slot per running sequence for the Gated DeltaNet layers (the split
//! llama.cpp makes between attention memory and recurrent memory). The storage itself lives
//! in the backend; this module only hands out indices.

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CacheError {
    #[error("out of KV blocks: need {need}, {free} free")]
    OutOfBlocks { need: usize, free: usize },
    #[error("out of recurrent-state slots")]
    OutOfSlots,
}

/// Fixed-size KV blocks handed out from a free list.
#[derive(Debug)]
pub struct BlockAllocator {
    block_size: usize,
    free: Vec<u32>,
    total: usize,
}

impl BlockAllocator {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        // Pop from the end: lowest ids first, which keeps tests readable.
        BlockAllocator { block_size, free: (0..num_blocks as u32).rev().collect(), total: num_blocks }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_total(&self) -> usize {
        self.total
    }

    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` so it covers `tokens` positions.
    pub fn ensure(&mut self, table: &mut Vec<u32>, tokens: usize) -> Result<(), CacheError> {
        let need = self.blocks_for(tokens).saturating_sub(table.len());
        if need > self.free.len() {
            return Err(CacheError::OutOfBlocks { need, free: self.free.len() });
        }
        for _ in 0..need {
            table.push(self.free.pop().expect("checked above"));
        }
        Ok(())
    }

    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.extend(table.drain(..).rev());
    }
}

/// Recurrent-state slots, one per running sequence.
#[derive(Debug)]
pub struct SlotAllocator {
    free: Vec<usize>,
    total: usize,
}

impl SlotAllocator {
    pub fn new(slots: usize) -> Self {
        SlotAllocator { free: (0..slots).rev().collect(), total: slots }
    }

    pub fn allocate(&mut self) -> Result<usize, CacheError> {
        self.free.pop().ok_or(CacheError::OutOfSlots)
    }

    pub fn release(&mut self, slot: usize) {
        debug_assert!(!self.free.contains(&slot), "slot {slot} released twice");
        self.free.push(slot);
    }

    pub fn num_used(&self) -> usize {
        self.total - self.free.len()
    }

    pub fn num_total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_grow_and_return() {
        let mut a = BlockAllocator::new(4, 16);
        let mut t = Vec::new();
        a.ensure(&mut t, 17).unwrap();
        assert_eq!(t, vec![0, 1]);
        a.ensure(&mut t, 32).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(a.ensure(&mut t, 100), Err(CacheError::OutOfBlocks { need: 5, free: 2 }));
        assert_eq!(t.len(), 2, "a failed request takes nothing");
        a.release(&mut t);
        assert_eq!(a.num_free(), 4);
    }

    #[test]
    fn slots_run_out_cleanly() {
        let mut s = SlotAllocator::new(1);
        let x = s.allocate().unwrap();
        assert_eq!(s.allocate(), Err(CacheError::OutOfSlots));
        s.release(x);
        assert_eq!(s.num_used(), 0);
    }
}

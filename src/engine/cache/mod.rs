//! Bookkeeping of the hybrid cache: paged KV blocks for the attention layers, one
//! recurrent-state slot per running sequence for the Gated DeltaNet layers (the split
//! llama.cpp makes between attention memory and recurrent memory), and the prefix cache that
//! shares both between requests. The storage itself lives in the backend; this module only
//! hands out indices.

pub mod blocks;
pub mod prefix;

pub use blocks::BlockPool;
pub use prefix::{checkpoint_position, PrefixCache, PrefixCacheStats, PrefixHit};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CacheError {
    #[error("out of KV blocks: need {need}, {free} free")]
    OutOfBlocks { need: usize, free: usize },
    #[error("out of recurrent-state slots")]
    OutOfSlots,
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
    fn slots_run_out_cleanly() {
        let mut s = SlotAllocator::new(1);
        let x = s.allocate().unwrap();
        assert_eq!(s.allocate(), Err(CacheError::OutOfSlots));
        s.release(x);
        assert_eq!(s.num_used(), 0);
    }
}

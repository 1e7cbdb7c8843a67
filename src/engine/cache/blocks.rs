//! Paged KV blocks with reference counts, shared between requests through the prefix cache.
//!
//! A block is *free* (nothing anyone will look for), *in use* (referenced by one or more
//! requests), or *cached*: unreferenced, but registered under the key of its content, so that
//! a later request with the same prefix can take it back instead of computing it again. New
//! blocks come from the free list first, then by evicting the cached block released longest
//! ago (a request's tail blocks are released before its head, so its tail goes first).
//!
//! Keys are exact: a block's key is the node of the block before it plus its own tokens (and
//! the one after, see [`BlockKey`]), compared in full, so a hit never rests on a hash. Node ids
//! are never reused: once a block is evicted its node is gone, and so is every chain through it.

use super::CacheError;
use std::collections::{BTreeMap, HashMap};

/// The identity of one cached prefix: the exact tokens `0..=end` of a chain of blocks.
pub type NodeId = u64;

/// The parent of a sequence's first block.
pub const ROOT: NodeId = 0;

/// What a cached block holds: keys and values of positions `[start, start + block_size)` of
/// any sequence whose tokens up to the block's end are those of the chain `parent` continued
/// by `tokens[..block_size]`. `tokens` also holds the token after the block: the draft
/// layer's keys and values at the block's last position are computed from it (MTP reads
/// `token[p + 1]` at position `p`), so two blocks that differ only there are different.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub parent: NodeId,
    pub tokens: Box<[u32]>,
}

#[derive(Debug)]
struct Registration {
    key: BlockKey,
    node: NodeId,
    /// The block also holds the draft (MTP) layer's keys and values of its positions.
    draft_kv: bool,
}

/// A block found under a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FoundBlock {
    pub block: u32,
    pub node: NodeId,
    pub draft_kv: bool,
}

#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    registered: Vec<Option<Registration>>,
    by_key: HashMap<BlockKey, u32>,
    /// Unreferenced blocks without content anyone looks for; handed out first.
    free: Vec<u32>,
    /// Unreferenced registered blocks by release stamp, oldest first.
    evictable: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    clock: u64,
    next_node: NodeId,
    /// Nodes of evicted blocks, until [`BlockPool::take_evicted`] collects them.
    evicted: Vec<NodeId>,
    /// Blocks held by more than one request.
    shared: usize,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        BlockPool {
            block_size,
            refs: vec![0; num_blocks],
            registered: (0..num_blocks).map(|_| None).collect(),
            by_key: HashMap::new(),
            // Pop from the end: lowest ids first, which keeps tests readable.
            free: (0..num_blocks as u32).rev().collect(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            clock: 0,
            next_node: ROOT + 1,
            evicted: Vec::new(),
            shared: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks a request can get: free ones and cached ones no request holds.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    pub fn num_total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks registered in the prefix cache (held by requests or not).
    pub fn num_cached(&self) -> usize {
        self.by_key.len()
    }

    /// Blocks held by more than one request at once.
    pub fn num_shared(&self) -> usize {
        self.shared
    }

    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` so it covers `tokens` positions. Takes nothing when it cannot take all.
    pub fn ensure(&mut self, table: &mut Vec<u32>, tokens: usize) -> Result<(), CacheError> {
        let need = self.blocks_for(tokens).saturating_sub(table.len());
        if need > self.num_free() {
            return Err(CacheError::OutOfBlocks { need, free: self.num_free() });
        }
        for _ in 0..need {
            let block = match self.free.pop() {
                Some(b) => b,
                None => self.evict_oldest(),
            };
            self.refs[block as usize] = 1;
            table.push(block);
        }
        Ok(())
    }

    fn evict_oldest(&mut self) -> u32 {
        let (_, block) = self.evictable.pop_first().expect("num_free counted an evictable block");
        let reg = self.registered[block as usize].take().expect("evictable blocks are registered");
        self.by_key.remove(&reg.key);
        self.evicted.push(reg.node);
        block
    }

    /// Drops one reference to each block of `table`, tail first: blocks nobody holds become
    /// free, or cached if registered (the tail released first, so evicted first).
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for block in table.drain(..).rev() {
            let b = block as usize;
            debug_assert!(self.refs[b] > 0, "block {block} released more often than taken");
            self.refs[b] -= 1;
            if self.refs[b] == 1 {
                self.shared -= 1;
            }
            if self.refs[b] > 0 {
                continue;
            }
            if self.registered[b].is_some() {
                self.clock += 1;
                self.released_at[b] = self.clock;
                self.evictable.insert(self.clock, block);
            } else {
                self.free.push(block);
            }
        }
    }

    /// The block registered under `key`, if any.
    pub fn find(&self, key: &BlockKey) -> Option<FoundBlock> {
        let &block = self.by_key.get(key)?;
        let reg = self.registered[block as usize].as_ref().expect("by_key holds registered blocks");
        Some(FoundBlock { block, node: reg.node, draft_kv: reg.draft_kv })
    }

    /// Takes a reference to a block found in the cache.
    pub fn acquire(&mut self, block: u32) {
        let b = block as usize;
        if self.refs[b] == 0 {
            self.evictable.remove(&self.released_at[b]).expect("an unreferenced registered block is evictable");
        }
        self.refs[b] += 1;
        if self.refs[b] == 2 {
            self.shared += 1;
        }
    }

    /// Registers `block` (held, not yet registered) under `key` and returns the node a chain
    /// continues from. When `key` is taken already, the block registered there stays (this
    /// one remains a private copy), unless that one lacks the draft layer's keys and values
    /// and this one has them: then this block takes its place and its node.
    pub fn register(&mut self, block: u32, key: BlockKey, draft_kv: bool) -> NodeId {
        let b = block as usize;
        debug_assert!(self.refs[b] > 0 && self.registered[b].is_none(), "block {block} is not a held, private block");
        let node = match self.by_key.get(&key) {
            Some(&other) => {
                let o = other as usize;
                let existing = self.registered[o].as_ref().expect("by_key holds registered blocks");
                if existing.draft_kv || !draft_kv {
                    return existing.node;
                }
                let node = existing.node;
                self.registered[o] = None;
                if self.refs[o] == 0 {
                    self.evictable.remove(&self.released_at[o]);
                    self.free.push(other);
                }
                node
            }
            None => {
                let node = self.next_node;
                self.next_node += 1;
                node
            }
        };
        self.by_key.insert(key.clone(), block);
        self.registered[b] = Some(Registration { key, node, draft_kv });
        node
    }

    /// Nodes whose blocks were evicted since the last call.
    pub fn take_evicted(&mut self) -> Vec<NodeId> {
        std::mem::take(&mut self.evicted)
    }

    /// References held on `block` (for tests and assertions).
    pub fn ref_count(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(parent: NodeId, t: u32) -> BlockKey {
        BlockKey { parent, tokens: vec![t; 5].into() }
    }

    #[test]
    fn blocks_grow_and_return() {
        let mut a = BlockPool::new(4, 16);
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
    fn released_registered_blocks_stay_findable_until_evicted_oldest_first() {
        let mut pool = BlockPool::new(3, 4);
        let mut t = Vec::new();
        pool.ensure(&mut t, 8).unwrap();
        let n0 = pool.register(t[0], key(ROOT, 1), true);
        let n1 = pool.register(t[1], key(n0, 2), true);
        pool.release(&mut t);
        assert_eq!(pool.num_free(), 3, "cached blocks can be handed out");
        assert_eq!(pool.find(&key(ROOT, 1)).map(|f| f.block), Some(0));
        // One new block comes from the free list: nothing is evicted.
        let mut u = Vec::new();
        pool.ensure(&mut u, 4).unwrap();
        assert_eq!(u, vec![2]);
        assert!(pool.take_evicted().is_empty());
        // The next one evicts the tail block first (released first).
        pool.ensure(&mut u, 8).unwrap();
        assert_eq!(u, vec![2, 1]);
        assert_eq!(pool.take_evicted(), vec![n1]);
        assert_eq!(pool.find(&key(n0, 2)), None, "an evicted block is never found");
        assert!(pool.find(&key(ROOT, 1)).is_some());
    }

    #[test]
    fn shared_blocks_count_references() {
        let mut pool = BlockPool::new(2, 4);
        let mut a = Vec::new();
        pool.ensure(&mut a, 4).unwrap();
        let node = pool.register(a[0], key(ROOT, 7), false);
        let found = pool.find(&key(ROOT, 7)).unwrap();
        assert_eq!((found.node, found.draft_kv), (node, false));
        pool.acquire(found.block);
        let mut b = vec![found.block];
        assert_eq!((pool.ref_count(found.block), pool.num_shared()), (2, 1));
        pool.release(&mut a);
        assert_eq!(pool.num_shared(), 0);
        assert_eq!(pool.num_free(), 1, "still held by the second table");
        pool.release(&mut b);
        assert_eq!(pool.num_free(), 2);
        // Taken back from the cache: no longer evictable.
        pool.acquire(found.block);
        assert_eq!(pool.num_free(), 1);
        let mut c = Vec::new();
        assert!(pool.ensure(&mut c, 8).is_err());
        pool.ensure(&mut c, 4).unwrap();
        assert_eq!(c, vec![1]);
    }

    #[test]
    fn a_duplicate_stays_private_unless_it_adds_draft_kv() {
        let mut pool = BlockPool::new(3, 4);
        let mut t = Vec::new();
        pool.ensure(&mut t, 12).unwrap();
        let first = pool.register(t[0], key(ROOT, 3), false);
        // Same content without more: the first registration stays.
        assert_eq!(pool.register(t[1], key(ROOT, 3), false), first);
        assert_eq!(pool.find(&key(ROOT, 3)).unwrap().block, t[0]);
        // With the draft layer's KV: it takes the place and the node of the first.
        assert_eq!(pool.register(t[2], key(ROOT, 3), true), first);
        assert_eq!(pool.find(&key(ROOT, 3)).unwrap(), FoundBlock { block: t[2], node: first, draft_kv: true });
        assert_eq!(pool.num_cached(), 1);
        let registered = t[2];
        pool.release(&mut t);
        // The other two hold nothing anyone looks for: free, and handed out before it.
        let mut u = Vec::new();
        pool.ensure(&mut u, 8).unwrap();
        assert!(!u.contains(&registered));
        assert!(pool.take_evicted().is_empty());
    }
}

//! Automatic prefix caching for the hybrid models: a request whose prompt begins like an
//! earlier one resumes where the cache holds both the attention keys and values and the
//! recurrent state of that beginning, and prefills only the rest.
//!
//! What is cached, and why the output stays bitwise the same (DESIGN Invariants 3 and 5):
//!
//! - Attention layers keep KV blocks of 16 tokens ([`super::blocks::BlockPool`]); a full block
//!   is found by the exact chain of its tokens (each block's key is its parent's node and its
//!   own tokens, plus the token after it, which the MTP layer's KV at the block's last
//!   position depends on).
//! - The Gated DeltaNet layers cannot be cut back to an earlier position, so their state (conv
//!   window and delta-rule state of every linear layer) is copied to a *checkpoint* slot at
//!   positions that are multiples of 64, the delta-rule chunk. Checkpoints live in a memory
//!   budget of their own and are evicted least recently used first.
//! - Only what the prefill path computed is cached: prompt positions, in whole 64-token chunks
//!   aligned to absolute positions. Decode and verify rows run the recurrent form of the delta
//!   rule, whose rounding differs from the chunked form, so generated tokens are never cached
//!   as such; a chat reply becomes cacheable when the next turn prefills it as part of its
//!   prompt. The prefill of a prompt's last, partial chunk is not cached either.
//! - The rule: a prompt of `n` tokens caches its blocks below `c = `[`checkpoint_position`]`(n)`,
//!   the largest multiple of 64 below `n`, and checkpoints at `c` and at every other multiple
//!   of 64 where one of its prefill pieces ends. The scheduler ends a piece at `c` (a request
//!   has one row per step, so the state at `c` exists only if a piece ends there); pieces
//!   already end at multiples of 64, so this changes no chunk.
//! - A request resumes at the largest multiple of 64, `r`, such that its first `r` tokens and
//!   the token at `r` match cached blocks and a checkpoint exists at `r`. Since `r < n`, at
//!   least one prompt token is computed, which gives the logits of the last prompt position.
//!   The chunks it then computes are the very chunks a run without the cache computes, from
//!   the same state, so every later bit is the same.
//! - A request drafting with MTP also needs the MTP layer's KV of the cached positions: it
//!   only takes blocks that an MTP request filled (the others are used by every other request).

use super::blocks::{BlockKey, BlockPool, NodeId, ROOT};
use crate::backend::DELTA_RULE_CHUNK as CHUNK;
use std::collections::{BTreeMap, HashMap};

/// The position up to which a prompt of `prompt_len` tokens is cached, and where its last
/// checkpoint is taken: the largest multiple of 64 below `prompt_len` (0: nothing cached).
pub fn checkpoint_position(prompt_len: usize) -> usize {
    prompt_len.saturating_sub(1) / CHUNK * CHUNK
}

/// Counters of the prefix cache, for metrics and displays.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PrefixCacheStats {
    /// Admissions that looked for a cached prefix.
    pub queries: u64,
    /// Admissions that resumed from one.
    pub hits: u64,
    /// Prompt tokens of the admissions that looked.
    pub queried_tokens: u64,
    /// Prompt tokens served from the cache instead of being computed.
    pub cached_tokens: u64,
    /// Checkpoints evicted to make room for newer ones.
    pub evicted_checkpoints: u64,
    /// Checkpoints held now, and the most that fit the budget.
    pub checkpoints: usize,
    pub checkpoint_capacity: usize,
    /// KV blocks registered in the cache (held by requests or not).
    pub cached_blocks: usize,
    /// KV blocks held by more than one request at once.
    pub shared_blocks: usize,
}

impl PrefixCacheStats {
    /// Cached tokens over queried tokens; 0 before any query.
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.queried_tokens as f64
        }
    }
}

/// A cached prefix a request resumes from: its blocks (referenced for the request), their
/// nodes, and the checkpoint holding the recurrent state after them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixHit {
    pub blocks: Vec<u32>,
    pub nodes: Vec<NodeId>,
    pub checkpoint: usize,
}

pub struct PrefixCache {
    checkpoints: CheckpointPool,
    stats: PrefixCacheStats,
}

impl PrefixCache {
    /// A cache holding up to `checkpoints` recurrent-state checkpoints.
    pub fn new(checkpoints: usize) -> Self {
        PrefixCache { checkpoints: CheckpointPool::new(checkpoints), stats: PrefixCacheStats::default() }
    }

    pub fn stats(&self, pool: &BlockPool) -> PrefixCacheStats {
        PrefixCacheStats { checkpoints: self.checkpoints.len(), checkpoint_capacity: self.checkpoints.capacity(), cached_blocks: pool.num_cached(), shared_blocks: pool.num_shared(), ..self.stats.clone() }
    }

    /// The longest cached prefix `prompt` can resume from, its blocks referenced; `None` when
    /// there is none. With `need_draft_kv`, only blocks holding the MTP layer's KV count.
    pub fn lookup(&mut self, pool: &mut BlockPool, prompt: &[u32], need_draft_kv: bool) -> Option<PrefixHit> {
        self.forget_evicted(pool);
        self.stats.queries += 1;
        self.stats.queried_tokens += prompt.len() as u64;
        let bs = pool.block_size();
        let mut parent = ROOT;
        let mut found = Vec::new();
        let mut resume_blocks = 0;
        // The token after a block is part of its key, so a block ending at the last prompt
        // position is never looked for (and never cached).
        for b in 0.. {
            let end = (b + 1) * bs;
            if end >= prompt.len() {
                break;
            }
            let key = BlockKey { parent, tokens: prompt[b * bs..=end].into() };
            let Some(f) = pool.find(&key) else { break };
            if need_draft_kv && !f.draft_kv {
                break;
            }
            found.push(f);
            parent = f.node;
            if end.is_multiple_of(CHUNK) && self.checkpoints.contains(f.node) {
                resume_blocks = found.len();
            }
        }
        if resume_blocks == 0 {
            return None;
        }
        found.truncate(resume_blocks);
        let checkpoint = self.checkpoints.get(found[resume_blocks - 1].node).expect("checked while walking");
        for f in &found {
            pool.acquire(f.block);
        }
        self.stats.hits += 1;
        self.stats.cached_tokens += (resume_blocks * bs) as u64;
        Some(PrefixHit { blocks: found.iter().map(|f| f.block).collect(), nodes: found.iter().map(|f| f.node).collect(), checkpoint })
    }

    /// After a prefill piece of a request: registers the blocks of `prompt` that are complete
    /// (`computed` positions are) and cacheable, continuing the chain `nodes` (one node per
    /// block of `table` already registered or found), and reserves a checkpoint if the piece
    /// ended at a checkpoint position. Returns the checkpoint slot the request's recurrent state
    /// must be copied to now; `None` when none is due or the position is held already.
    pub fn record_prefill(&mut self, pool: &mut BlockPool, prompt: &[u32], computed: usize, table: &[u32], nodes: &mut Vec<NodeId>, draft_kv: bool) -> Option<usize> {
        self.forget_evicted(pool);
        let bs = pool.block_size();
        let limit = checkpoint_position(prompt.len()).min(computed);
        for b in nodes.len()..limit / bs {
            let parent = nodes.last().copied().unwrap_or(ROOT);
            let key = BlockKey { parent, tokens: prompt[b * bs..=(b + 1) * bs].into() };
            nodes.push(pool.register(table[b], key, draft_kv));
        }
        if computed != limit || limit == 0 {
            return None;
        }
        let (slot, evicted) = self.checkpoints.insert(nodes[limit / bs - 1])?;
        self.stats.evicted_checkpoints += u64::from(evicted);
        Some(slot)
    }

    /// Checkpoints of evicted blocks can never be reached again: their slots are freed.
    fn forget_evicted(&mut self, pool: &mut BlockPool) {
        for node in pool.take_evicted() {
            self.checkpoints.remove(node);
        }
    }
}

/// Checkpoint slots by the node of the prefix they hold, evicted least recently used first.
struct CheckpointPool {
    slot_of: HashMap<NodeId, usize>,
    node_in: Vec<Option<NodeId>>,
    used_at: Vec<u64>,
    lru: BTreeMap<u64, usize>,
    free: Vec<usize>,
    clock: u64,
}

impl CheckpointPool {
    fn new(capacity: usize) -> Self {
        CheckpointPool { slot_of: HashMap::new(), node_in: vec![None; capacity], used_at: vec![0; capacity], lru: BTreeMap::new(), free: (0..capacity).rev().collect(), clock: 0 }
    }

    fn capacity(&self) -> usize {
        self.node_in.len()
    }

    fn len(&self) -> usize {
        self.slot_of.len()
    }

    fn contains(&self, node: NodeId) -> bool {
        self.slot_of.contains_key(&node)
    }

    fn stamp(&mut self, slot: usize) {
        self.lru.remove(&self.used_at[slot]);
        self.clock += 1;
        self.used_at[slot] = self.clock;
        self.lru.insert(self.clock, slot);
    }

    /// The slot holding `node`'s state, marked as just used.
    fn get(&mut self, node: NodeId) -> Option<usize> {
        let slot = *self.slot_of.get(&node)?;
        self.stamp(slot);
        Some(slot)
    }

    /// A slot for `node`'s state, and whether another checkpoint was evicted for it; `None`
    /// when `node` has one already (it is marked as used) or the pool has no slots.
    fn insert(&mut self, node: NodeId) -> Option<(usize, bool)> {
        if self.get(node).is_some() {
            return None;
        }
        let (slot, evicted) = match self.free.pop() {
            Some(slot) => (slot, false),
            None => {
                let (_, slot) = self.lru.pop_first()?;
                let old = self.node_in[slot].take().expect("a slot in the LRU order holds a node");
                self.slot_of.remove(&old);
                (slot, true)
            }
        };
        self.node_in[slot] = Some(node);
        self.slot_of.insert(node, slot);
        self.stamp(slot);
        Some((slot, evicted))
    }

    fn remove(&mut self, node: NodeId) {
        if let Some(slot) = self.slot_of.remove(&node) {
            self.lru.remove(&self.used_at[slot]);
            self.node_in[slot] = None;
            self.free.push(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 16;

    fn prompt(len: usize, salt: u32) -> Vec<u32> {
        (0..len as u32).map(|i| (i * 7 + salt) % 101).collect()
    }

    /// Prefill of `p` in pieces ending at `ends`, as one request holding its own blocks;
    /// returns the checkpoint slots reserved and the request's table.
    fn prefill(cache: &mut PrefixCache, pool: &mut BlockPool, p: &[u32], ends: &[usize], draft_kv: bool) -> (Vec<Option<usize>>, Vec<u32>) {
        let mut table = Vec::new();
        let mut nodes = Vec::new();
        let mut saved = Vec::new();
        for &end in ends {
            pool.ensure(&mut table, end).unwrap();
            saved.push(cache.record_prefill(pool, p, end, &table, &mut nodes, draft_kv));
        }
        (saved, table)
    }

    #[test]
    fn checkpoint_positions() {
        assert_eq!(checkpoint_position(0), 0);
        assert_eq!(checkpoint_position(64), 0, "the state at the prompt's end is never needed by it");
        assert_eq!(checkpoint_position(65), 64);
        assert_eq!(checkpoint_position(128), 64);
        assert_eq!(checkpoint_position(200), 192);
    }

    #[test]
    fn a_longer_prompt_resumes_at_the_last_checkpoint_of_a_shorter_one() {
        let mut pool = BlockPool::new(64, BS);
        let mut cache = PrefixCache::new(4);
        let first = prompt(200, 0);
        // Pieces end at 128 (a budget cut), 192 (the checkpoint position) and 200.
        let (saved, mut table) = prefill(&mut cache, &mut pool, &first, &[128, 192, 200], true);
        assert_eq!(saved, vec![Some(0), Some(1), None]);
        pool.release(&mut table);
        assert_eq!(pool.num_cached(), 12, "blocks below 192 are cached");

        let mut second = first.clone();
        second.extend(prompt(50, 3));
        let hit = cache.lookup(&mut pool, &second, true).expect("hit");
        assert_eq!((hit.blocks.len(), hit.checkpoint), (12, 1));
        // The same prompt again: its last position must be computed, so it resumes at 192 too.
        let again = cache.lookup(&mut pool, &first, true).expect("hit");
        assert_eq!(again.blocks.len(), 12);
        // One token different at 150: back to the checkpoint at 128.
        let mut third = second.clone();
        third[150] += 1;
        let hit = cache.lookup(&mut pool, &third, true).expect("hit");
        assert_eq!((hit.blocks.len(), hit.checkpoint), (8, 0));
        // Different from the first block on: nothing.
        let mut fourth = second.clone();
        fourth[3] += 1;
        assert_eq!(cache.lookup(&mut pool, &fourth, true), None);
        let stats = cache.stats(&pool);
        assert_eq!((stats.queries, stats.hits, stats.cached_tokens), (4, 3, 192 + 192 + 128));
    }

    #[test]
    fn the_token_after_a_checkpoint_is_part_of_its_key() {
        let mut pool = BlockPool::new(16, BS);
        let mut cache = PrefixCache::new(2);
        let p = prompt(100, 1);
        let (_, mut table) = prefill(&mut cache, &mut pool, &p, &[64, 100], true);
        pool.release(&mut table);
        let mut other = p.clone();
        other[64] += 1;
        assert_eq!(cache.lookup(&mut pool, &other, true), None, "the MTP KV at 63 was computed from another token 64");
        assert!(cache.lookup(&mut pool, &p, true).is_some());
    }

    #[test]
    fn mtp_requests_take_only_blocks_holding_draft_kv() {
        let mut pool = BlockPool::new(16, BS);
        let mut cache = PrefixCache::new(2);
        let p = prompt(100, 2);
        let (_, mut table) = prefill(&mut cache, &mut pool, &p, &[64, 100], false);
        pool.release(&mut table);
        assert_eq!(cache.lookup(&mut pool, &p, true), None);
        let hit = cache.lookup(&mut pool, &p, false).expect("any other request takes them");
        let mut held = hit.blocks.clone();
        // An MTP request computes the same blocks with draft KV: they replace the others.
        let (saved, mut table) = prefill(&mut cache, &mut pool, &p, &[64, 100], true);
        assert_eq!(saved, vec![None, None], "the checkpoint at 64 exists already");
        pool.release(&mut table);
        let hit = cache.lookup(&mut pool, &p, true).expect("now an MTP request hits");
        assert!(hit.blocks.iter().all(|b| !held.contains(b)), "the blocks with draft KV are used");
        pool.release(&mut held);
    }

    #[test]
    fn evicted_blocks_take_their_checkpoints_with_them() {
        let mut pool = BlockPool::new(8, BS);
        let mut cache = PrefixCache::new(4);
        let p = prompt(100, 4);
        let (_, mut table) = prefill(&mut cache, &mut pool, &p, &[64, 100], true);
        pool.release(&mut table);
        assert_eq!(cache.stats(&pool).checkpoints, 1);
        // Another request takes every block: the cached ones are evicted and reused.
        let mut other = Vec::new();
        pool.ensure(&mut other, 8 * BS).unwrap();
        assert_eq!(cache.lookup(&mut pool, &p, true), None, "freed and reused blocks are never hit");
        assert_eq!(cache.stats(&pool).checkpoints, 0, "their checkpoint was dropped");
        pool.release(&mut other);
        assert_eq!(cache.lookup(&mut pool, &p, true), None);
    }

    #[test]
    fn checkpoints_are_evicted_least_recently_used_first() {
        let mut pool = BlockPool::new(64, BS);
        let mut cache = PrefixCache::new(2);
        let (a, b, c) = (prompt(70, 10), prompt(70, 20), prompt(70, 30));
        for p in [&a, &b] {
            let (saved, mut table) = prefill(&mut cache, &mut pool, p, &[64, 70], true);
            assert!(saved[0].is_some());
            pool.release(&mut table);
        }
        // Using a makes b the least recently used.
        let mut held = cache.lookup(&mut pool, &a, true).expect("hit").blocks;
        pool.release(&mut held);
        let (_, mut table) = prefill(&mut cache, &mut pool, &c, &[64, 70], true);
        pool.release(&mut table);
        let stats = cache.stats(&pool);
        assert_eq!((stats.checkpoints, stats.evicted_checkpoints), (2, 1));
        assert!(cache.lookup(&mut pool, &b, true).is_none(), "b was evicted");
        for p in [&a, &c] {
            let mut held = cache.lookup(&mut pool, p, true).expect("kept").blocks;
            pool.release(&mut held);
        }
    }
}

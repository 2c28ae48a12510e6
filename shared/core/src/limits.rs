//! Every size limit the draft and verify sides must agree on, in one place.
//!
//! The verify side's configurable limits (`max_tree_nodes`, `max_tree_levels`,
//! `max_dist_entries`) default to these values; the draft side never builds or accepts a tree
//! beyond them, so a tree the draft sends is never refused for its shape by a default verify
//! node.

/// Most nodes in one tree (root included): draft `tree.nodes`, forced trees, verify default.
pub const MAX_TREE_NODES: usize = 512;
/// Most levels in one tree (root = 1 level): draft `tree.max_levels`, forced trees, verify
/// default. The planner searches no deeper.
pub const MAX_TREE_LEVELS: usize = 32;
/// Most entries in one node's sparse draft distribution on the wire (verify default).
pub const MAX_DIST_ENTRIES: usize = 1024;
/// Largest node budget the cost-model search considers (a bound on its work, above any
/// configurable tree size).
pub const MAX_PLANNED_NODES: usize = 1024;
/// Most stop strings in one request, and the longest one in bytes.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_BYTES: usize = 256;
/// Largest gRPC message either service sends or accepts (a 512-node tree with 64-entry
/// distributions is about 0.4 MB; prompts of a 32k context are well under this).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;
/// How often one generation may move to another verify node before giving up.
pub const MAX_FAILOVERS: u32 = 8;

/// The tree limits as [`crate::tree::TreeLimits`].
pub const TREE: crate::tree::TreeLimits = crate::tree::TreeLimits {
    max_nodes: MAX_TREE_NODES,
    max_levels: MAX_TREE_LEVELS,
};

/// Most sizes in one `Profile` request and most repeats of each: bound the CPU work a single
/// call can ask for (64 × 20 forwards of at most `MAX_TREE_NODES` nodes).
pub const MAX_PROFILE_SIZES: usize = 64;
pub const MAX_PROFILE_REPEATS: u32 = 20;
/// Largest `Ping` reply.
pub const MAX_PING_BYTES: usize = 8 << 20;
/// Largest prompt in bytes (all chat messages together), checked before templating and
/// tokenization so an oversized request costs no CPU. 1 MiB is far above any context we serve.
pub const MAX_PROMPT_BYTES: usize = 1 << 20;
/// Most chat messages in one request.
pub const MAX_CHAT_MESSAGES: usize = 4096;

/// Version of the draft ↔ verify protocol this build speaks, and the oldest it still accepts.
/// Version 1 is the protocol before versioning (peers that send no version field, i.e. 0, are
/// treated as 1). Bump `PROTOCOL_VERSION` on any change to the Session messages' meaning; raise
/// `MIN_PROTOCOL_VERSION` only when the old meaning is no longer understood.
pub const PROTOCOL_VERSION: u32 = 4;
pub const MIN_PROTOCOL_VERSION: u32 = 1;

/// First protocol version whose sessions take `decode` (the verify-side decode fallback); a
/// draft sends it only on sessions that negotiated this version or later.
pub const DECODE_PROTOCOL_VERSION: u32 = 3;

/// First protocol version whose sessions take trees sent ahead (`VerifyTree.assumes`): the draft
/// node sends the next tree before the verdict it assumes, and the verify node verifies it as
/// soon as that verdict holds (docs/ALGORITHMS.md §10, "Trees sent ahead").
pub const AHEAD_PROTOCOL_VERSION: u32 = 4;

/// Most tokens one `decode` message may ask for.
pub const MAX_DECODE_TOKENS: u32 = 1024;

/// The protocol version a peer reported (0 = a peer from before versioning = 1).
pub fn peer_protocol(reported: u32) -> u32 {
    reported.max(1)
}

/// Whether a peer speaking versions `min..=max` (as it reported them; 0 = unversioned) can talk
/// to this build. Returns the version both use.
pub fn negotiate_protocol(peer_min: u32, peer_max: u32) -> Option<u32> {
    let (lo, hi) = (peer_protocol(peer_min), peer_protocol(peer_max));
    let common = hi.min(PROTOCOL_VERSION);
    (common >= lo.max(MIN_PROTOCOL_VERSION)).then_some(common)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_versions_negotiate() {
        // An unversioned peer is version 1, which this build still speaks.
        assert_eq!(negotiate_protocol(0, 0), Some(1));
        assert_eq!(negotiate_protocol(1, 2), Some(2));
        // A newer peer that still speaks ours.
        assert_eq!(negotiate_protocol(1, 9), Some(PROTOCOL_VERSION));
        // A peer that no longer speaks ours.
        assert_eq!(
            negotiate_protocol(PROTOCOL_VERSION + 1, PROTOCOL_VERSION + 3),
            None
        );
    }
}

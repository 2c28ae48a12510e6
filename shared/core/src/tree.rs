//! Token trees: a parent array in BFS order with rank-ordered children.
//!
//! Node 0 is the root (the last committed token, not yet processed by either model). Every other
//! node's parent has a smaller index, nodes are grouped level by level (BFS order), and the
//! children of a node appear in rank order (the order the draft produced them). The parent array
//! is the wire and file format; depths, children lists, level widths and the ancestor mask used
//! by tree attention are derived from it.

use serde::{Deserialize, Serialize};

/// Hard limits for trees accepted from untrusted input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLimits {
    pub max_nodes: usize,
    pub max_levels: usize,
}

impl Default for TreeLimits {
    fn default() -> Self {
        Self {
            max_nodes: 1024,
            max_levels: 64,
        }
    }
}

/// Why a parent array is not a valid tree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("tree is empty: it needs at least the root node")]
    Empty,
    #[error("parents[0] must be -1 (the root), got {0}")]
    BadRoot(i64),
    #[error("parents[{index}] = {parent}: a non-root node needs a parent in 0..{index}")]
    ParentOutOfRange { index: usize, parent: i64 },
    #[error(
        "parents[{index}] = {parent} breaks BFS order: node {index} is at depth {depth}, after a node at depth {prev_depth}"
    )]
    NotBfs {
        index: usize,
        parent: i64,
        depth: usize,
        prev_depth: usize,
    },
    #[error(
        "parents[{index}] = {parent} breaks child order: children of a level must be grouped by parent in parent order"
    )]
    ChildrenNotGrouped { index: usize, parent: i64 },
    #[error("tree has {nodes} nodes, more than the limit of {limit}")]
    TooManyNodes { nodes: usize, limit: usize },
    #[error("tree has {levels} levels, more than the limit of {limit}")]
    TooManyLevels { levels: usize, limit: usize },
}

/// A validated token tree shape (no tokens: those travel beside it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TreeJson", into = "TreeJson")]
pub struct Tree {
    parents: Vec<i32>,
    depths: Vec<u32>,
    /// children[v] = indices of v's children in rank order.
    children: Vec<Vec<u32>>,
    /// Number of nodes at each level (level 0 = root).
    widths: Vec<usize>,
    /// Row-major bitset: bit j of row i is set when j is an ancestor of i or i itself.
    ancestors: Vec<u64>,
    words_per_row: usize,
}

/// A tree with a chain merged in ([`Tree::graft_chain`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grafted {
    pub tree: Tree,
    pub tokens: Vec<u32>,
    /// origin[v] = the node's index in the tree before grafting; None for added nodes.
    pub origin: Vec<Option<usize>>,
    /// Indices (in the new tree) of the added nodes, root side first.
    pub added: Vec<usize>,
}

#[derive(Serialize, Deserialize)]
struct TreeJson {
    parents: Vec<i32>,
}

impl TryFrom<TreeJson> for Tree {
    type Error = TreeError;
    fn try_from(j: TreeJson) -> Result<Self, TreeError> {
        Tree::from_parents(&j.parents)
    }
}

impl From<Tree> for TreeJson {
    fn from(t: Tree) -> Self {
        TreeJson { parents: t.parents }
    }
}

impl Tree {
    /// Validate a parent array with the default limits.
    pub fn from_parents(parents: &[i32]) -> Result<Self, TreeError> {
        Self::from_parents_limited(parents, TreeLimits::default())
    }

    /// Validate an untrusted parent array: BFS order, parents before children, children of one
    /// level grouped by parent in parent order, within `limits`.
    pub fn from_parents_limited(parents: &[i32], limits: TreeLimits) -> Result<Self, TreeError> {
        let n = parents.len();
        if n == 0 {
            return Err(TreeError::Empty);
        }
        if n > limits.max_nodes {
            return Err(TreeError::TooManyNodes {
                nodes: n,
                limit: limits.max_nodes,
            });
        }
        if parents[0] != -1 {
            return Err(TreeError::BadRoot(parents[0] as i64));
        }
        let mut depths = vec![0u32; n];
        for i in 1..n {
            let p = parents[i];
            if p < 0 || p as usize >= i {
                return Err(TreeError::ParentOutOfRange {
                    index: i,
                    parent: p as i64,
                });
            }
            let p = p as usize;
            depths[i] = depths[p] + 1;
            if depths[i] < depths[i - 1] {
                return Err(TreeError::NotBfs {
                    index: i,
                    parent: p as i64,
                    depth: depths[i] as usize,
                    prev_depth: depths[i - 1] as usize,
                });
            }
            // Within a level, parents must be non-decreasing so that each node's children are
            // contiguous and ordered by parent (BFS).
            if i > 1 && depths[i] == depths[i - 1] && (p as i32) < parents[i - 1] {
                return Err(TreeError::ChildrenNotGrouped {
                    index: i,
                    parent: p as i64,
                });
            }
        }
        let levels = depths[n - 1] as usize + 1;
        if levels > limits.max_levels {
            return Err(TreeError::TooManyLevels {
                levels,
                limit: limits.max_levels,
            });
        }
        Ok(Self::build(parents.to_vec(), depths))
    }

    fn build(parents: Vec<i32>, depths: Vec<u32>) -> Self {
        let n = parents.len();
        let mut children = vec![Vec::new(); n];
        for (i, &p) in parents.iter().enumerate().skip(1) {
            children[p as usize].push(i as u32);
        }
        let levels = depths[n - 1] as usize + 1;
        let mut widths = vec![0usize; levels];
        for &d in &depths {
            widths[d as usize] += 1;
        }
        let words = n.div_ceil(64);
        let mut ancestors = vec![0u64; n * words];
        for i in 0..n {
            if i > 0 {
                let p = parents[i] as usize;
                let (before, after) = ancestors.split_at_mut(i * words);
                after[..words].copy_from_slice(&before[p * words..(p + 1) * words]);
            }
            ancestors[i * words + i / 64] |= 1u64 << (i % 64);
        }
        Tree {
            parents,
            depths,
            children,
            widths,
            ancestors,
            words_per_row: words,
        }
    }

    /// A spine: `width` children at every level, the first child of each level carrying the
    /// next, `depth` levels below the root. Every rank is tried at every depth the accepted
    /// path reaches, which is what measuring the acceptance vector by depth needs.
    pub fn spine(width: usize, depth: usize) -> Self {
        let mut parents = vec![-1i32];
        let mut head = 0i32;
        for _ in 0..depth {
            let first = parents.len() as i32;
            parents.extend(std::iter::repeat_n(head, width));
            head = first;
        }
        Self::from_parents_limited(
            &parents,
            TreeLimits {
                max_nodes: usize::MAX,
                max_levels: usize::MAX,
            },
        )
        .expect("a spine is a valid tree")
    }

    /// A chain root → 1 → 2 → … with `n` nodes.
    pub fn chain(n: usize) -> Self {
        assert!(n >= 1, "a chain needs at least the root");
        let parents: Vec<i32> = (0..n as i32).map(|i| i - 1).collect();
        Self::from_parents_limited(
            &parents,
            TreeLimits {
                max_nodes: usize::MAX,
                max_levels: usize::MAX,
            },
        )
        .expect("a chain is a valid tree")
    }

    /// Root with `k` children and nothing else.
    pub fn star(k: usize) -> Self {
        let mut parents = vec![-1];
        parents.extend(std::iter::repeat_n(0, k));
        Self::from_parents(&parents).expect("a star is a valid tree")
    }

    /// SpecInfer-style: `k` independent chains of `d` drafted tokens below the root.
    pub fn k_by_d(k: usize, d: usize) -> Self {
        let mut parents = vec![-1i32];
        if d > 0 {
            parents.extend(std::iter::repeat_n(0, k));
            for level in 1..d {
                let base = 1 + (level - 1) * k;
                parents.extend((0..k).map(|j| (base + j) as i32));
            }
        }
        Self::from_parents_limited(
            &parents,
            TreeLimits {
                max_nodes: usize::MAX,
                max_levels: usize::MAX,
            },
        )
        .expect("k×d is a valid tree")
    }

    /// Follow `chain` down from the root, each token through the child of the node reached that
    /// carries it (`tokens[v]` is node v's token): the node where it stops and how many of
    /// `chain`'s tokens it followed. What [`graft_chain`](Self::graft_chain) merges instead of
    /// adding nodes.
    pub fn follow_chain(&self, tokens: &[u32], chain: &[u32]) -> (usize, usize) {
        let mut at = 0usize;
        let mut matched = 0usize;
        while let Some(&c) = chain
            .get(matched)
            .and_then(|&t| self.children[at].iter().find(|&&c| tokens[c as usize] == t))
        {
            at = c as usize;
            matched += 1;
        }
        (at, matched)
    }

    /// Merge the token chain `chain` into this tree below the root (`tokens` are the nodes'
    /// tokens): follow the children whose tokens match the chain as far as they do, then hang
    /// the rest below the last matched node as a new chain, each new node its parent's last
    /// child (so existing nodes keep their ranks). The result is re-indexed into BFS order.
    /// A prompt-lookup branch joins a drafted tree this way (docs/ALGORITHMS.md §9).
    pub fn graft_chain(&self, tokens: &[u32], chain: &[u32]) -> Grafted {
        assert_eq!(tokens.len(), self.len(), "one token per node");
        let n = self.len();
        let (at, matched) = self.follow_chain(tokens, chain);
        // Old nodes keep their ids; new ones are n, n + 1, ... in chain order.
        let added = chain.len() - matched;
        let mut kids: Vec<Vec<usize>> = self
            .children
            .iter()
            .map(|c| c.iter().map(|&x| x as usize).collect())
            .collect();
        kids.resize(n + added, Vec::new());
        let mut parent = at;
        for j in 0..added {
            kids[parent].push(n + j);
            parent = n + j;
        }
        let token_of = |v: usize| {
            if v < n {
                tokens[v]
            } else {
                chain[matched + v - n]
            }
        };
        // BFS over the merged children lists yields levels grouped by parent in parent order.
        let mut order = vec![0usize];
        let mut new_index = vec![0usize; n + added];
        let mut parents = vec![-1i32];
        let mut head = 0;
        while head < order.len() {
            let v = order[head];
            for &c in &kids[v] {
                new_index[c] = order.len();
                parents.push(new_index[v] as i32);
                order.push(c);
            }
            head += 1;
        }
        let tree = Self::from_parents_limited(
            &parents,
            TreeLimits {
                max_nodes: usize::MAX,
                max_levels: usize::MAX,
            },
        )
        .expect("a BFS walk gives a valid tree");
        Grafted {
            tokens: order.iter().map(|&v| token_of(v)).collect(),
            origin: order.iter().map(|&v| (v < n).then_some(v)).collect(),
            added: (n..n + added).map(|v| new_index[v]).collect(),
            tree,
        }
    }

    pub fn len(&self) -> usize {
        self.parents.len()
    }

    /// Always false: a tree has at least its root.
    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn parents(&self) -> &[i32] {
        &self.parents
    }

    pub fn parent(&self, i: usize) -> Option<usize> {
        (i > 0).then(|| self.parents[i] as usize)
    }

    pub fn depth(&self, i: usize) -> usize {
        self.depths[i] as usize
    }

    pub fn depths(&self) -> &[u32] {
        &self.depths
    }

    /// Children of `i` in rank order.
    pub fn children(&self, i: usize) -> &[u32] {
        &self.children[i]
    }

    /// Number of levels (root alone = 1).
    pub fn levels(&self) -> usize {
        self.widths.len()
    }

    /// Nodes per level.
    pub fn widths(&self) -> &[usize] {
        &self.widths
    }

    /// Node indices of level `d` (contiguous in BFS order).
    pub fn level_range(&self, d: usize) -> std::ops::Range<usize> {
        let start: usize = self.widths[..d].iter().sum();
        start..start + self.widths[d]
    }

    /// True when `a` is an ancestor of `b` or `a == b` (tree attention: b attends to a).
    pub fn attends(&self, b: usize, a: usize) -> bool {
        self.ancestors[b * self.words_per_row + a / 64] >> (a % 64) & 1 == 1
    }

    /// Nodes that have at least one child, in index order (the nodes that carry a draft q).
    pub fn expanded_nodes(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter(|&i| !self.children[i].is_empty())
    }

    /// Root-to-node path, root included.
    pub fn path_to(&self, mut i: usize) -> Vec<usize> {
        let mut path = vec![i];
        while let Some(p) = self.parent(i) {
            path.push(p);
            i = p;
        }
        path.reverse();
        path
    }

    /// The 1-based rank of node `i` among its siblings (0 for the root).
    pub fn rank(&self, i: usize) -> usize {
        match self.parent(i) {
            None => 0,
            Some(p) => {
                self.children[p]
                    .iter()
                    .position(|&c| c as usize == i)
                    .unwrap()
                    + 1
            }
        }
    }

    /// Indented drawing, one node per line, each labelled with its rank path.
    pub fn draw(&self) -> String {
        let mut out = String::new();
        let mut stack = vec![(0usize, String::from("root"))];
        while let Some((v, label)) = stack.pop() {
            out.push_str(&"  ".repeat(self.depth(v)));
            out.push_str(&label);
            out.push('\n');
            for (r, &c) in self.children[v].iter().enumerate().rev() {
                stack.push((c as usize, format!("#{} (rank {})", c, r + 1)));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Root-to-node token paths of a tree, as sequences.
    fn paths(tree: &Tree, tokens: &[u32]) -> Vec<Vec<u32>> {
        (0..tree.len())
            .map(|v| tree.path_to(v).iter().map(|&u| tokens[u]).collect())
            .collect()
    }

    #[test]
    fn graft_merges_a_chain_into_bfs_order() {
        // root(10) → a(11) → c(13); root → b(12). Chain 11 14 15 follows a, then branches.
        let tree = Tree::from_parents(&[-1, 0, 0, 1]).unwrap();
        let tokens = [10, 11, 12, 13];
        let g = tree.graft_chain(&tokens, &[11, 14, 15]);
        assert_eq!(g.tree.len(), 6);
        assert_eq!(g.added.len(), 2);
        // Every old path survives with the same tokens; the chain is a path from the root.
        let new_paths = paths(&g.tree, &g.tokens);
        for p in paths(&tree, &tokens) {
            assert!(new_paths.contains(&p), "{p:?} lost");
        }
        assert!(new_paths.contains(&vec![10, 11, 14, 15]));
        // Origins map old nodes back, and old nodes keep their rank among siblings.
        for (v, o) in g.origin.iter().enumerate() {
            match o {
                Some(o) => assert_eq!(g.tokens[v], tokens[*o]),
                None => assert!(g.added.contains(&v)),
            }
        }
        let a = g.origin.iter().position(|&o| o == Some(1)).unwrap();
        let kids = g.tree.children(a);
        assert_eq!(
            g.origin[kids[0] as usize],
            Some(3),
            "drafted child stays first"
        );
        assert_eq!(
            g.origin[kids[1] as usize], None,
            "the grafted one comes last"
        );
    }

    #[test]
    fn graft_of_a_chain_already_present_adds_nothing() {
        let tree = Tree::from_parents(&[-1, 0, 1]).unwrap();
        let g = tree.graft_chain(&[5, 6, 7], &[6, 7]);
        assert_eq!(g.tree, tree);
        assert!(g.added.is_empty());
        assert_eq!(g.origin, vec![Some(0), Some(1), Some(2)]);
        // And onto a root alone, the chain is the tree.
        let g = Tree::chain(1).graft_chain(&[5], &[1, 2, 3]);
        assert_eq!(g.tree, Tree::chain(4));
        assert_eq!(g.tokens, vec![5, 1, 2, 3]);
    }

    proptest::proptest! {
        #[test]
        fn graft_keeps_every_path_and_adds_the_chain(
            raw in proptest::collection::vec(0u8..6, 0..24),
            chain in proptest::collection::vec(0u32..4, 0..6),
        ) {
            // Random BFS tree: node i+1 hangs below a node of the previous or current level;
            // sibling tokens distinct (as drafted trees have them).
            let mut parents = vec![-1i32];
            let mut tokens = vec![9u32];
            for r in &raw {
                // Non-decreasing parents give BFS order with children grouped by parent.
                let last = parents.last().map_or(0, |&l| l.max(0) as usize);
                let p = (*r as usize % parents.len()).max(last);
                let used: Vec<u32> = (0..parents.len())
                    .filter(|&j| parents[j] == p as i32)
                    .map(|j| tokens[j])
                    .collect();
                let Some(t) = (0..4u32).find(|t| !used.contains(t)) else { continue };
                parents.push(p as i32);
                tokens.push(t);
            }
            let tree = Tree::from_parents_limited(&parents, TreeLimits { max_nodes: 64, max_levels: 64 }).unwrap();
            let g = tree.graft_chain(&tokens, &chain);
            let new_paths = paths(&g.tree, &g.tokens);
            for p in paths(&tree, &tokens) {
                proptest::prop_assert!(new_paths.contains(&p));
            }
            let mut want = vec![9u32];
            want.extend_from_slice(&chain);
            proptest::prop_assert!(new_paths.contains(&want));
            proptest::prop_assert_eq!(g.tree.len(), tree.len() + g.added.len());
            // Siblings stay distinct.
            for v in 0..g.tree.len() {
                let kids: Vec<u32> = g.tree.children(v).iter().map(|&c| g.tokens[c as usize]).collect();
                let mut dedup = kids.clone();
                dedup.sort();
                dedup.dedup();
                proptest::prop_assert_eq!(dedup.len(), kids.len());
            }
        }
    }

    #[test]
    fn spine_shape() {
        let s = Tree::spine(3, 2);
        assert_eq!(s.len(), 7);
        assert_eq!(s.levels(), 3);
        assert_eq!(s.children(0).len(), 3);
        assert_eq!(s.children(1).len(), 3);
        assert!(
            s.children(2).is_empty(),
            "only the first child carries the next level"
        );
    }

    #[test]
    fn derived_fields() {
        let t = Tree::from_parents(&[-1, 0, 0, 1, 1, 2, 3]).unwrap();
        assert_eq!(t.depths(), &[0, 1, 1, 2, 2, 2, 3]);
        assert_eq!(t.widths(), &[1, 2, 3, 1]);
        assert_eq!(t.levels(), 4);
        assert_eq!(t.children(1), &[3, 4]);
        assert_eq!(t.path_to(6), vec![0, 1, 3, 6]);
        assert!(t.attends(6, 0) && t.attends(6, 1) && t.attends(6, 3) && t.attends(6, 6));
        assert!(!t.attends(6, 2) && !t.attends(6, 4) && !t.attends(3, 6));
        assert_eq!(t.rank(4), 2);
        assert_eq!(t.level_range(2), 3..6);
        assert_eq!(t.expanded_nodes().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    }

    #[test]
    fn ancestor_mask_beyond_64_nodes() {
        let t = Tree::chain(200);
        assert!(t.attends(199, 0) && t.attends(199, 130) && t.attends(130, 64));
        assert!(!t.attends(64, 130));
    }

    #[test]
    fn rejects_bad_trees_with_named_problem() {
        assert_eq!(Tree::from_parents(&[]), Err(TreeError::Empty));
        assert_eq!(Tree::from_parents(&[0]), Err(TreeError::BadRoot(0)));
        assert!(matches!(
            Tree::from_parents(&[-1, 1]),
            Err(TreeError::ParentOutOfRange {
                index: 1,
                parent: 1
            })
        ));
        assert!(matches!(
            Tree::from_parents(&[-1, 0, 5]),
            Err(TreeError::ParentOutOfRange { index: 2, .. })
        ));
        assert!(matches!(
            Tree::from_parents(&[-1, 0, 1, 0]),
            Err(TreeError::NotBfs { index: 3, .. })
        ));
        assert!(matches!(
            Tree::from_parents(&[-1, 0, 0, 2, 1]),
            Err(TreeError::ChildrenNotGrouped { index: 4, .. })
        ));
        let lim = TreeLimits {
            max_nodes: 4,
            max_levels: 3,
        };
        assert!(matches!(
            Tree::from_parents_limited(&[-1, 0, 0, 0, 0], lim),
            Err(TreeError::TooManyNodes { nodes: 5, limit: 4 })
        ));
        assert!(matches!(
            Tree::from_parents_limited(&[-1, 0, 1, 2], lim),
            Err(TreeError::TooManyLevels {
                levels: 4,
                limit: 3
            })
        ));
        let msg = Tree::from_parents(&[-1, 0, 7]).unwrap_err().to_string();
        assert!(msg.contains("parents[2] = 7"), "{msg}");
    }

    #[test]
    fn json_round_trip_and_validation() {
        let t: Tree = serde_json::from_str(r#"{ "parents": [-1, 0, 0, 1] }"#).unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"parents":[-1,0,0,1]}"#
        );
        assert!(serde_json::from_str::<Tree>(r#"{ "parents": [-1, 3] }"#).is_err());
    }

    #[test]
    fn baseline_shapes() {
        assert_eq!(Tree::k_by_d(3, 2).parents(), &[-1, 0, 0, 0, 1, 2, 3]);
        assert_eq!(Tree::chain(3).parents(), &[-1, 0, 1]);
        assert_eq!(Tree::star(2).parents(), &[-1, 0, 0]);
    }
}

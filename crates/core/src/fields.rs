//! The fields a manager owns (`managedFields` entries' `fieldsV1`), as the write-skip
//! ([`crate::apply::up_to_date`]) reads them, and the one copy of each such set the stores
//! share ([`intern`]).
//!
//! Every child of one kind that an operator applied from one builder has the same set of
//! owned fields: the paths stop at a list (`f:ownerReferences`, `f:subjects`), so object
//! names, uids and values are not in it. A store keeps, in each object's entry, a short
//! reference to the shared set ([`crate::cache::trim`]) instead of the entry's own
//! `fieldsV1` tree: about 0.5 KiB less per cached object.
//!
//! # Guarantees
//! - A reference made by [`intern`] reads back ([`owned`]) as the very set it was made from,
//!   for the life of the process: sets are never dropped or replaced, so a cached object's
//!   reference cannot go stale or point at another set.
//! - At most [`MAX_SETS`] sets are kept. Past that, an entry keeps its fields as JSON text
//!   (what every entry cost before), so a stream of objects with ever new field sets (label
//!   keys chosen by users) costs what it did, not an unbounded table.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use serde_json::Value;

/// Leaf field paths (`["metadata", "labels", "app"]`): a path stops at a scalar, an empty
/// struct (an atomic field: `f:roleRef: {}`) or a list (`k:`/`v:`/`i:` members).
pub type Paths = BTreeSet<Vec<String>>;

/// How many distinct sets [`intern`] keeps at most.
pub const MAX_SETS: usize = 4096;

/// What an interned entry's `fieldsV1` holds: this prefix and the set's number.
const REFERENCE: &str = "steward:fields#";

#[derive(Default)]
struct Sets {
    numbers: HashMap<Arc<Paths>, usize>,
    sets: Vec<Arc<Paths>>,
}

impl Sets {
    /// The number of `set`, kept now if it is new and fewer than `max` are kept.
    fn number(&mut self, set: Paths, max: usize) -> Option<usize> {
        if let Some(n) = self.numbers.get(&set) {
            return Some(*n);
        }
        if self.sets.len() >= max {
            return None;
        }
        let set = Arc::new(set);
        let n = self.sets.len();
        self.sets.push(set.clone());
        self.numbers.insert(set, n);
        Some(n)
    }
}

static SETS: LazyLock<Mutex<Sets>> = LazyLock::new(Mutex::default);

/// The paths of a `fieldsV1` tree, in `out`: descends through `f:<field>` keys; a node
/// without such children (a scalar, or a list keyed by `k:`/`v:`/`i:`) is a leaf.
pub fn paths(node: &Value, prefix: &mut Vec<String>, out: &mut Paths) {
    let children: Vec<(&String, &Value)> = node
        .as_object()
        .map(|m| m.iter().filter(|(k, _)| k.starts_with("f:")).collect())
        .unwrap_or_default();
    if children.is_empty() {
        if !prefix.is_empty() {
            out.insert(prefix.clone());
        }
        return;
    }
    for (k, v) in children {
        prefix.push(k[2..].to_string());
        paths(v, prefix, out);
        prefix.pop();
    }
}

/// What a store keeps of an entry's `fieldsV1` tree: a reference to the shared copy of its
/// paths, or (past [`MAX_SETS`]) the tree as JSON text. A value already packed is returned
/// as it is.
pub fn intern(fields: &Value) -> Value {
    if fields.is_string() {
        return fields.clone();
    }
    let mut set = Paths::new();
    paths(fields, &mut Vec::new(), &mut set);
    let number = SETS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .number(set, MAX_SETS);
    Value::String(match number {
        Some(n) => format!("{REFERENCE}{n}"),
        None => {
            let mut text = fields.to_string();
            text.shrink_to_fit();
            text
        }
    })
}

/// The paths of an entry's `fieldsV1`: a tree as the API server sends it, its JSON text, or
/// an [`intern`] reference. `None` for a reference this process did not make (never the
/// case for an object of its own stores) or text that is not JSON.
pub fn owned(fields: &Value) -> Option<Arc<Paths>> {
    let mut set = Paths::new();
    match fields {
        Value::String(s) => match s.strip_prefix(REFERENCE) {
            Some(n) => {
                let n: usize = n.parse().ok()?;
                let sets = SETS.lock().unwrap_or_else(PoisonError::into_inner);
                return sets.sets.get(n).cloned();
            }
            None => paths(&serde_json::from_str(s).ok()?, &mut Vec::new(), &mut set),
        },
        tree => paths(tree, &mut Vec::new(), &mut set),
    }
    Some(Arc::new(set))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Paths, Sets, intern, owned};

    #[test]
    fn children_with_the_same_fields_share_one_set() {
        let of = |uid: &str, label: &str| {
            json!({"f:metadata": {
                "f:labels": {format!("f:{label}"): {}},
                "f:ownerReferences": {format!("k:{{\"uid\":\"{uid}\"}}"): {}},
            }, "f:roleRef": {}, "f:subjects": {}})
        };
        let (a, b, c) = (
            intern(&of("u-1", "app")),
            intern(&of("u-2", "app")),
            intern(&of("u-1", "tier")),
        );
        assert_eq!(a, b, "owner uids are not part of the set");
        assert_ne!(a, c, "label keys are");
        let set = owned(&a).expect("a reference made here reads back");
        let paths: Vec<String> = set.iter().map(|p| p.join(".")).collect();
        assert_eq!(
            paths,
            [
                "metadata.labels.app",
                "metadata.ownerReferences",
                "roleRef",
                "subjects"
            ]
        );
        assert_eq!(
            owned(&of("u-9", "app")),
            Some(set),
            "the tree reads the same"
        );
        assert_eq!(intern(&a), a, "a packed value stays as it is");
    }

    #[test]
    fn text_and_foreign_references_read_as_json_or_nothing() {
        let tree = json!({"f:data": {"f:k": {}}});
        let text = serde_json::Value::String(tree.to_string());
        assert_eq!(owned(&text), owned(&tree));
        assert_eq!(owned(&json!("steward:fields#999999999")), None);
        assert_eq!(owned(&json!("not json")), None);
    }

    #[test]
    fn past_the_bound_no_set_is_kept_and_the_kept_ones_stay() {
        let set = |field: &str| Paths::from([vec![field.to_string()]]);
        let mut sets = Sets::default();
        assert_eq!(sets.number(set("a"), 2), Some(0));
        assert_eq!(sets.number(set("b"), 2), Some(1));
        assert_eq!(sets.number(set("c"), 2), None);
        assert_eq!(sets.number(set("a"), 2), Some(0));
        assert_eq!(sets.sets.len(), 2);
    }
}

//! The tenant-wide quota, split into per-namespace ResourceQuota hard limits (pure).
//!
//! # Guarantees
//! The sum over the tenant's namespaces of what each ResourceQuota *enforces* never exceeds the
//! tenant's limit, so the namespaces together cannot exceed it, even when pods are created in
//! all of them at once. How:
//!
//! - each namespace gets what it uses plus an equal share of what is free
//!   (`hard = used + share`, water-filled under the per-namespace limit if there is one), so
//!   the shares sum to the tenant's limit exactly;
//! - the API server enforces a ResourceQuota's `status.hard`, which the quota controller copies
//!   from `spec.hard` a moment after each change. A namespace's limit is therefore only
//!   *raised* once every namespace's enforced limit is already at or below its new target
//!   ([`Plan::held_back`] names the resources still waiting); lowering is always safe;
//! - the operator writes each ResourceQuota with its `resourceVersion` as a precondition, so a
//!   limit is never computed from usage that changed since it was read (the quota admission
//!   bumps the ResourceQuota on every create).
//!
//! # Caveats
//! Objects that already existed in a namespace when it joined the tenant count only once the
//! quota controller has computed their usage; a namespace whose usage is unknown counts as
//! using nothing. A namespace can only grow beyond its share after its usage changed and the
//! split was recomputed, so filling the whole tenant from one namespace takes several rounds.

use std::collections::{BTreeMap, BTreeSet};

use crate::quantity::Milli;

/// What one namespace's ResourceQuota looks like now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observed {
    pub namespace: String,
    /// `spec.hard`, `None` if the namespace has no ResourceQuota yet.
    pub spec_hard: Option<BTreeMap<String, Milli>>,
    /// `status.hard`: what the API server currently enforces.
    pub enforced: BTreeMap<String, Milli>,
    /// `status.used`.
    pub used: BTreeMap<String, Milli>,
}

/// The hard limits to write, per namespace.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub hard: BTreeMap<String, BTreeMap<String, Milli>>,
    /// Resources whose increases wait until the lowered limits are enforced.
    pub held_back: BTreeSet<String>,
}

impl Plan {
    /// Whether the plan lowers any limit of `namespace` relative to `current`.
    pub fn lowers(&self, namespace: &str, current: Option<&BTreeMap<String, Milli>>) -> bool {
        let (Some(want), Some(current)) = (self.hard.get(namespace), current) else {
            return false;
        };
        want.iter()
            .any(|(r, v)| current.get(r).is_some_and(|c| v < c))
            || current.keys().any(|r| !want.contains_key(r))
    }
}

/// Splits `tenant` (tenant-wide limits) over `namespaces`, combined with the per-namespace
/// limits `per_namespace`. Without a tenant-wide quota every namespace simply gets
/// `per_namespace`.
pub fn plan(
    per_namespace: &BTreeMap<String, Milli>,
    tenant: &BTreeMap<String, Milli>,
    namespaces: &[Observed],
) -> Plan {
    let mut hard: BTreeMap<String, BTreeMap<String, Milli>> = namespaces
        .iter()
        .map(|n| (n.namespace.clone(), per_namespace.clone()))
        .collect();
    let mut held_back = BTreeSet::new();
    for (resource, &total) in tenant {
        let used: Vec<Milli> = namespaces
            .iter()
            .map(|n| n.used.get(resource).copied().unwrap_or_default())
            .collect();
        let caps: Vec<Option<Milli>> = namespaces
            .iter()
            .map(|_| per_namespace.get(resource).copied())
            .collect();
        let target = split(total, &used, &caps);
        let raise_allowed = namespaces
            .iter()
            .zip(&target)
            .all(|(n, t)| n.enforced.get(resource).copied().unwrap_or_default() <= *t);
        for (n, t) in namespaces.iter().zip(&target) {
            let current = n
                .spec_hard
                .as_ref()
                .and_then(|h| h.get(resource))
                .copied()
                .unwrap_or_default();
            let value = if *t > current && !raise_allowed {
                held_back.insert(resource.clone());
                current
            } else {
                *t
            };
            hard.entry(n.namespace.clone())
                .or_default()
                .insert(resource.clone(), value);
        }
    }
    Plan { hard, held_back }
}

/// `used[i] + share[i]` for each namespace: the free amount (`total - Σ used`) water-filled in
/// equal shares, no namespace above its cap. Whole units when every input is whole; units
/// that do not divide evenly go to the namespaces using the most (ties: the later one), a
/// choice that depends on usage only, so it never flips back and forth by itself.
/// Namespaces over the total keep what they use (never less; lowering below use would not
/// free anything).
pub fn split(total: Milli, used: &[Milli], caps: &[Option<Milli>]) -> Vec<Milli> {
    let whole = total.is_whole()
        && used.iter().all(|u| u.is_whole())
        && caps.iter().flatten().all(|c| c.is_whole());
    let grain: i128 = if whole { 1000 } else { 1 };
    let sum: i128 = used.iter().map(|u| u.0.max(0)).sum();
    let mut free = (total.0 - sum).max(0) / grain;
    let rooms: Vec<i128> = used
        .iter()
        .zip(caps)
        .map(|(u, c)| c.map_or(i128::MAX, |c| ((c.0 - u.0.max(0)).max(0)) / grain))
        .collect();
    // Fill the smallest rooms first, so what a capped namespace cannot take goes to the others;
    // among equal rooms the biggest users come last, where the remainder accumulates.
    let mut order: Vec<usize> = (0..used.len()).collect();
    order.sort_by_key(|&i| (rooms[i], used[i], i));
    let mut share = vec![0i128; used.len()];
    let mut left = used.len() as i128;
    for &i in &order {
        let give = (free / left).min(rooms[i]);
        share[i] = give;
        free -= give;
        left -= 1;
    }
    used.iter()
        .zip(&share)
        .zip(caps)
        .map(|((u, s), c)| {
            let target = Milli(u.0.max(0) + s * grain);
            // A namespace over its own cap is held at the cap.
            match c {
                Some(c) if target > *c => *c,
                _ => target,
            }
        })
        .collect()
}

/// Per resource, the summed usage over `namespaces`.
pub fn total_used(namespaces: &[Observed]) -> BTreeMap<String, Milli> {
    let mut out: BTreeMap<String, Milli> = BTreeMap::new();
    for n in namespaces {
        for (r, v) in &n.used {
            let e = out.entry(r.clone()).or_default();
            *e = e.saturating_add(*v);
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn u(n: i64) -> Milli {
        Milli::units(n)
    }

    fn obs(ns: &str, spec: Option<i64>, enforced: Option<i64>, used: i64) -> Observed {
        Observed {
            namespace: ns.into(),
            spec_hard: spec.map(|s| BTreeMap::from([("pods".to_string(), u(s))])),
            enforced: enforced
                .map(|e| BTreeMap::from([("pods".to_string(), u(e))]))
                .unwrap_or_default(),
            used: BTreeMap::from([("pods".to_string(), u(used))]),
        }
    }

    #[test]
    fn split_gives_use_plus_equal_share_and_sums_to_total() {
        assert_eq!(split(u(10), &[u(0), u(0)], &[None, None]), [u(5), u(5)]);
        assert_eq!(split(u(10), &[u(4), u(0)], &[None, None]), [u(7), u(3)]);
        assert_eq!(
            split(u(5), &[u(0), u(0)], &[None, None]),
            [u(2), u(3)],
            "remainder lands on one namespace"
        );
        let s = split(u(7), &[u(1), u(2), u(0)], &[None, None, None]);
        assert_eq!(s.iter().map(|m| m.0).sum::<i128>(), u(7).0, "{s:?}");
    }

    #[test]
    fn split_never_goes_below_use_nor_above_caps() {
        assert_eq!(
            split(u(4), &[u(3), u(3)], &[None, None]),
            [u(3), u(3)],
            "over the total: frozen at use"
        );
        assert_eq!(
            split(u(10), &[u(0), u(0)], &[Some(u(2)), None]),
            [u(2), u(8)],
            "the capped share goes to others"
        );
        assert_eq!(
            split(u(10), &[u(5), u(0)], &[Some(u(3)), None]),
            [u(3), u(5)],
            "over its own cap: held at the cap"
        );
    }

    #[test]
    fn split_gives_the_remainder_to_the_biggest_user() {
        // One unit free: the namespace using more gets it, in either order.
        assert_eq!(split(u(6), &[u(4), u(1)], &[None, None]), [u(5), u(1)]);
        assert_eq!(split(u(6), &[u(1), u(4)], &[None, None]), [u(1), u(5)]);
    }

    #[test]
    fn split_uses_thousandths_for_fractional_quantities() {
        let s = split(Milli(1500), &[Milli(0), Milli(0)], &[None, None]);
        assert_eq!(s, [Milli(750), Milli(750)]);
        let s = split(u(1), &[Milli(0), Milli(0), Milli(0)], &[None, None, None]);
        assert_eq!(s.iter().map(|m| m.0).sum::<i128>(), 1000);
    }

    #[test]
    fn plan_without_tenant_quota_copies_the_namespace_quota() {
        let per = BTreeMap::from([("pods".to_string(), u(3))]);
        let p = plan(
            &per,
            &BTreeMap::new(),
            &[obs("a", None, None, 0), obs("b", Some(3), Some(3), 1)],
        );
        assert_eq!(p.hard["a"], per);
        assert_eq!(p.hard["b"], per);
        assert!(p.held_back.is_empty());
    }

    #[test]
    fn plan_raises_only_after_lowered_limits_are_enforced() {
        let tenant = BTreeMap::from([("pods".to_string(), u(6))]);
        // a uses 3 of 3, b uses 0 of 3: the free 3 is split 2 (the remainder, to the bigger
        // user a) + 1, so a's target rises to 5 and b's falls to 1.
        let before = [obs("a", Some(3), Some(3), 3), obs("b", Some(3), Some(3), 0)];
        let p = plan(&BTreeMap::new(), &tenant, &before);
        assert_eq!(p.hard["b"]["pods"], u(1), "b is lowered right away");
        assert_eq!(p.hard["a"]["pods"], u(3), "a waits: b still enforces 3");
        assert!(p.held_back.contains("pods"));
        assert!(p.lowers("b", before[1].spec_hard.as_ref()));
        assert!(!p.lowers("a", before[0].spec_hard.as_ref()));

        // Once b's lowered limit is enforced, a may rise.
        let after = [obs("a", Some(3), Some(3), 3), obs("b", Some(1), Some(1), 0)];
        let p = plan(&BTreeMap::new(), &tenant, &after);
        assert_eq!(p.hard["a"]["pods"], u(5));
        assert_eq!(p.hard["b"]["pods"], u(1));
        assert!(p.held_back.is_empty());
    }

    #[test]
    fn plan_for_a_new_namespace_starts_it_at_zero_until_others_shrink() {
        let tenant = BTreeMap::from([("pods".to_string(), u(4))]);
        let p = plan(
            &BTreeMap::new(),
            &tenant,
            &[obs("a", Some(4), Some(4), 0), obs("new", None, None, 0)],
        );
        assert_eq!(p.hard["a"]["pods"], u(2));
        assert_eq!(
            p.hard["new"]["pods"],
            u(0),
            "no share before a's lower limit is enforced"
        );
        let p = plan(
            &BTreeMap::new(),
            &tenant,
            &[
                obs("a", Some(2), Some(2), 0),
                obs("new", Some(0), Some(0), 0),
            ],
        );
        assert_eq!(p.hard["new"]["pods"], u(2));
    }

    #[test]
    fn enforced_sum_never_exceeds_the_tenant_limit_in_any_round() {
        // Simulate: usage arrives, the operator plans, the quota controller enforces, repeat.
        let tenant = BTreeMap::from([("pods".to_string(), u(5))]);
        let mut state = vec![
            obs("a", None, None, 0),
            obs("b", None, None, 0),
            obs("c", None, None, 0),
        ];
        let demand = [4i64, 1, 3];
        for _round in 0..20 {
            let p = plan(&BTreeMap::new(), &tenant, &state);
            for n in &mut state {
                n.spec_hard = Some(p.hard[&n.namespace].clone());
            }
            // The quota controller enforces the new specs; then every namespace uses what it can.
            for (i, n) in state.iter_mut().enumerate() {
                n.enforced = n.spec_hard.clone().unwrap_or_default();
                let cap = n.enforced["pods"];
                let want = u(demand[i]);
                let used = n.used["pods"].max(want.min(cap));
                n.used.insert("pods".into(), used);
            }
            let enforced: i128 = state.iter().map(|n| n.enforced["pods"].0).sum();
            let used: i128 = state.iter().map(|n| n.used["pods"].0).sum();
            assert!(enforced <= u(5).0, "enforced {enforced}");
            assert!(used <= u(5).0, "used {used}");
        }
        let used: i128 = state.iter().map(|n| n.used["pods"].0).sum();
        assert_eq!(used, u(5).0, "the tenant's whole limit becomes usable");
    }

    #[test]
    fn totals_sum_usage() {
        let t = total_used(&[obs("a", None, None, 2), obs("b", None, None, 3)]);
        assert_eq!(t["pods"], u(5));
    }
}

//! Which namespaces a tenant has, keeps, releases or deletes (pure).
//!
//! A tenant's namespaces are those listed in `spec.namespaces` (labelled `declared`) and those
//! its owners created with the tenant label. A declared namespace that left the spec is
//! removed according to `deletionPolicy`; an owner-created one stays until the Tenant goes.
//! A listed namespace that belongs to another tenant is a conflict and is left alone.

use std::collections::BTreeSet;

use crate::crd::{DECLARED_LABEL, TENANT_LABEL};

/// What the operator knows about one existing namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Existing {
    pub name: String,
    /// Value of the tenant label, if any.
    pub tenant: Option<String>,
    pub declared: bool,
    pub terminating: bool,
}

impl Existing {
    /// From a Namespace object.
    pub fn of(ns: &k8s_openapi::api::core::v1::Namespace) -> Self {
        let labels = ns.metadata.labels.as_ref();
        Existing {
            name: ns.metadata.name.clone().unwrap_or_default(),
            tenant: labels.and_then(|l| l.get(TENANT_LABEL)).cloned(),
            declared: labels
                .and_then(|l| l.get(DECLARED_LABEL))
                .is_some_and(|v| v == "true"),
            terminating: ns.metadata.deletion_timestamp.is_some(),
        }
    }
}

/// A namespace the tenant keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub name: String,
    /// Listed in `spec.namespaces`.
    pub declared: bool,
    /// Exists already.
    pub exists: bool,
    /// Being deleted (its contents are left alone until it is gone, then it is re-created).
    pub terminating: bool,
}

/// The outcome for one tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespacePlan {
    pub wanted: Vec<Wanted>,
    /// Listed namespaces labelled for another tenant: `(namespace, other tenant)`.
    pub conflicts: Vec<(String, String)>,
    /// Declared namespaces no longer listed (apply `deletionPolicy`).
    pub removed: Vec<String>,
}

impl NamespacePlan {
    /// Names of the wanted namespaces that are usable now (not terminating), sorted.
    pub fn active(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .wanted
            .iter()
            .filter(|w| !w.terminating)
            .map(|w| w.name.clone())
            .collect();
        v.sort();
        v
    }
}

/// Plans the namespaces of `tenant`: `listed` is `spec.namespaces`; `lookup` finds an existing
/// namespace by name; `labelled` are the existing namespaces labelled for this tenant.
pub fn plan(
    tenant: &str,
    listed: &[String],
    lookup: impl Fn(&str) -> Option<Existing>,
    labelled: &[Existing],
) -> NamespacePlan {
    let listed_set: BTreeSet<&str> = listed.iter().map(String::as_str).collect();
    let mut out = NamespacePlan::default();
    for name in listed {
        match lookup(name) {
            Some(e) if e.tenant.as_deref().is_some_and(|t| t != tenant) => {
                out.conflicts
                    .push((name.clone(), e.tenant.unwrap_or_default()));
            }
            Some(e) => out.wanted.push(Wanted {
                name: name.clone(),
                declared: true,
                exists: true,
                terminating: e.terminating,
            }),
            None => out.wanted.push(Wanted {
                name: name.clone(),
                declared: true,
                exists: false,
                terminating: false,
            }),
        }
    }
    for e in labelled {
        if e.tenant.as_deref() != Some(tenant) || listed_set.contains(e.name.as_str()) {
            continue;
        }
        if e.declared {
            if !e.terminating {
                out.removed.push(e.name.clone());
            }
        } else {
            out.wanted.push(Wanted {
                name: e.name.clone(),
                declared: false,
                exists: true,
                terminating: e.terminating,
            });
        }
    }
    out.wanted.sort_by(|a, b| a.name.cmp(&b.name));
    out.removed.sort();
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ns(name: &str, tenant: Option<&str>, declared: bool) -> Existing {
        Existing {
            name: name.into(),
            tenant: tenant.map(Into::into),
            declared,
            terminating: false,
        }
    }

    fn run(listed: &[&str], existing: &[Existing]) -> NamespacePlan {
        let listed: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
        let labelled: Vec<Existing> = existing
            .iter()
            .filter(|e| e.tenant.is_some())
            .cloned()
            .collect();
        plan(
            "acme",
            &listed,
            |n| existing.iter().find(|e| e.name == n).cloned(),
            &labelled,
        )
    }

    #[test]
    fn listed_namespaces_are_created_or_adopted() {
        let p = run(&["a", "b"], &[ns("b", None, false)]);
        assert_eq!(p.wanted.len(), 2);
        assert!(!p.wanted[0].exists && p.wanted[0].declared);
        assert!(
            p.wanted[1].exists,
            "an unlabelled namespace that is listed is adopted"
        );
        assert_eq!(p.active(), ["a", "b"]);
    }

    #[test]
    fn another_tenants_namespace_is_a_conflict() {
        let p = run(&["a"], &[ns("a", Some("other"), true)]);
        assert!(p.wanted.is_empty());
        assert_eq!(p.conflicts, [("a".to_string(), "other".to_string())]);
    }

    #[test]
    fn unlisted_declared_namespaces_are_removed_owner_created_ones_kept() {
        let p = run(
            &["a"],
            &[
                ns("a", Some("acme"), true),
                ns("old", Some("acme"), true),
                ns("mine", Some("acme"), false),
            ],
        );
        assert_eq!(p.removed, ["old"]);
        assert_eq!(p.active(), ["a", "mine"]);
        assert!(!p.wanted.iter().find(|w| w.name == "mine").unwrap().declared);
    }

    #[test]
    fn terminating_namespaces_are_neither_active_nor_removed_again() {
        let mut gone = ns("old", Some("acme"), true);
        gone.terminating = true;
        let mut dying = ns("a", Some("acme"), true);
        dying.terminating = true;
        let p = run(&["a"], &[gone, dying]);
        assert!(p.removed.is_empty());
        assert!(p.active().is_empty());
        assert!(p.wanted[0].terminating);
    }
}

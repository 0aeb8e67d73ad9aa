//! Which namespaces a tenant has, keeps, releases or deletes (pure).
//!
//! A tenant's namespaces are those listed in `spec.namespaces` (labelled `declared`) and those
//! its owners created with the tenant label. A declared namespace that left the spec is
//! removed according to `deletionPolicy`; an owner-created one stays until the Tenant goes.
//! A listed namespace that belongs to another tenant is a conflict and is left alone.
//!
//! Ownership is explicit: a listed namespace that already exists without the tenant label is
//! taken only if a cluster admin annotated it `tenancy.steward.dev/adopt-by: <tenant>`, and is
//! then labelled `adopted`. Adopted namespaces are released, never deleted, whatever the
//! deletion policy. System namespaces (`default`, `kube-*`), Steward's own and those named by
//! `--protected-namespace` are never given to a tenant.
//!
//! `maxNamespaces` is decided here, one tenant at a time, from a consistent read: admission can
//! only check the count against the Tenant's status, so several namespaces created at the same
//! instant can all pass it. Declared namespaces and those already admitted (labelled
//! [`ADMITTED_LABEL`]) are kept; owner-created ones not admitted yet are taken oldest first
//! (then by name) while the tenant is below its limit, and the rest are *excess*: the operator
//! deletes them before anyone is given access in them, so nothing in them can be lost.

use std::collections::BTreeSet;

use k8s_openapi::jiff::Timestamp;

use crate::crd::{
    ADMITTED_LABEL, ADOPT_ANNOTATION, ADOPTED_LABEL, CREATED_FOR_ANNOTATION, DECLARED_LABEL,
    TENANT_LABEL,
};

/// Namespaces never given to a tenant: `default`, every `kube-*` and the configured ones
/// (the operators' own namespaces by default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Protected {
    pub names: BTreeSet<String>,
}

impl Protected {
    /// Whether `name` may never belong to a tenant.
    pub fn contains(&self, name: &str) -> bool {
        name == "default" || name.starts_with("kube-") || self.names.contains(name)
    }
}

/// What the operator knows about one existing namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Existing {
    pub name: String,
    /// Value of the tenant label, if any.
    pub tenant: Option<String>,
    pub declared: bool,
    pub terminating: bool,
    /// Labelled `adopted`: it existed before the tenant took it.
    pub adopted: bool,
    /// The tenant a cluster admin handed it to (`tenancy.steward.dev/adopt-by`).
    pub adopt_by: Option<String>,
    /// The tenant the operator created it for (`tenancy.steward.dev/created-for`).
    pub created_for: Option<String>,
    /// Accepted by the operator (labelled [`ADMITTED_LABEL`], or given access before that label
    /// existed).
    pub admitted: bool,
    /// Its creation time (the order in which owner-created namespaces are admitted).
    pub created: Option<Timestamp>,
}

impl Existing {
    /// From a Namespace's metadata (all a decision reads of it).
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Self {
        let labels = meta.labels.as_ref();
        let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key)).cloned();
        Existing {
            name: meta.name.clone().unwrap_or_default(),
            tenant: labels.and_then(|l| l.get(TENANT_LABEL)).cloned(),
            declared: labels
                .and_then(|l| l.get(DECLARED_LABEL))
                .is_some_and(|v| v == "true"),
            terminating: meta.deletion_timestamp.is_some(),
            adopted: labels
                .and_then(|l| l.get(ADOPTED_LABEL))
                .is_some_and(|v| v == "true"),
            adopt_by: annotation(ADOPT_ANNOTATION),
            created_for: annotation(CREATED_FOR_ANNOTATION),
            admitted: labels
                .and_then(|l| l.get(ADMITTED_LABEL))
                .is_some_and(|v| v == "true"),
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
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
    /// It existed before the tenant took it: released, never deleted.
    pub adopted: bool,
}

/// A declared namespace no longer listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removed {
    pub name: String,
    /// Adopted: released whatever the deletion policy.
    pub adopted: bool,
}

/// The outcome for one tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespacePlan {
    pub wanted: Vec<Wanted>,
    /// Listed namespaces labelled for another tenant: `(namespace, other tenant)`.
    pub conflicts: Vec<(String, String)>,
    /// Declared namespaces no longer listed (apply `deletionPolicy`).
    pub removed: Vec<Removed>,
    /// Listed namespaces the tenant may not have: `(namespace, why)`.
    pub refused: Vec<(String, String)>,
    /// Owner-created namespaces beyond `maxNamespaces`, never admitted: to delete, sorted.
    pub excess: Vec<String>,
    /// The tenant keeps more namespaces than `maxNamespaces` (the limit was lowered, or
    /// namespaces were declared, after others were admitted): `(kept, max)`. None is removed.
    pub over_limit: Option<(usize, usize)>,
}

impl NamespacePlan {
    /// What keeps listed namespaces from the tenant: another tenant's, not adoptable, or the
    /// tenant over `maxNamespaces`.
    pub fn problems(&self) -> Vec<crate::status::Problem> {
        use crate::status::Problem;
        let conflicts = self.conflicts.iter().map(|(ns, other)| Problem {
            reason: "NamespaceConflict",
            message: format!("namespace {ns} belongs to tenant {other}"),
        });
        let refused = self.refused.iter().map(|(_, why)| Problem {
            reason: "NamespaceNotAdoptable",
            message: why.clone(),
        });
        let over = self.over_limit.map(|(kept, max)| Problem {
            reason: "MaxNamespacesExceeded",
            message: format!(
                "the tenant keeps {kept} namespaces, more than maxNamespaces {max} (lowered, or namespaces declared, after the others were admitted); none is removed, and no new one is admitted until it is below the limit"
            ),
        });
        let terminating = self
            .wanted
            .iter()
            .filter(|w| w.terminating && w.declared)
            .map(|w| Problem {
                reason: "NamespaceTerminating",
                message: format!(
                    "namespace {} is being deleted; it is re-created when it is gone",
                    w.name
                ),
            });
        conflicts
            .chain(refused)
            .chain(over)
            .chain(terminating)
            .collect()
    }

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
/// namespace by name (labelled or not); `labelled` are the existing namespaces labelled for
/// this tenant; `max` is `spec.maxNamespaces`.
pub fn plan(
    tenant: &str,
    listed: &[String],
    lookup: impl Fn(&str) -> Option<Existing>,
    labelled: &[Existing],
    protected: &Protected,
    max: Option<usize>,
) -> NamespacePlan {
    let listed_set: BTreeSet<&str> = listed.iter().map(String::as_str).collect();
    let mut out = NamespacePlan::default();
    for name in listed {
        if protected.contains(name) {
            out.refused.push((
                name.clone(),
                format!("namespace {name} is a system or Steward namespace and never belongs to a tenant"),
            ));
            continue;
        }
        let wanted = |exists: bool, terminating: bool, adopted: bool| Wanted {
            name: name.clone(),
            declared: true,
            exists,
            terminating,
            adopted,
        };
        match lookup(name) {
            None => out.wanted.push(wanted(false, false, false)),
            Some(e) => match e.tenant.as_deref() {
                Some(t) if t == tenant => out.wanted.push(wanted(true, e.terminating, e.adopted)),
                Some(other) => out.conflicts.push((name.clone(), other.to_string())),
                // Created for this tenant, not labelled yet (the apply after the create).
                None if e.created_for.as_deref() == Some(tenant) => {
                    out.wanted.push(wanted(true, e.terminating, false));
                }
                None if e.adopt_by.as_deref() == Some(tenant) => {
                    out.wanted.push(wanted(true, e.terminating, true));
                }
                None => out.refused.push((
                    name.clone(),
                    format!(
                        "namespace {name} exists and was not created for this tenant; a cluster admin hands it over with the annotation {ADOPT_ANNOTATION}={tenant}"
                    ),
                )),
            },
        }
    }
    let owner_created = |e: &Existing| Wanted {
        name: e.name.clone(),
        declared: false,
        exists: true,
        terminating: e.terminating,
        adopted: e.adopted,
    };
    let mut candidates = Vec::new();
    for e in labelled {
        if e.tenant.as_deref() != Some(tenant) || listed_set.contains(e.name.as_str()) {
            continue;
        }
        if e.declared {
            if !e.terminating {
                out.removed.push(Removed {
                    name: e.name.clone(),
                    adopted: e.adopted,
                });
            }
        } else if e.admitted || e.terminating || max.is_none() {
            out.wanted.push(owner_created(e));
        } else {
            candidates.push(e);
        }
    }
    // Owner-created namespaces not admitted yet: oldest first while below the limit. Declared
    // ones count whether they exist yet or not; terminating ones no longer count.
    let kept = out
        .wanted
        .iter()
        .filter(|w| !w.terminating || w.declared)
        .count();
    if let Some(max) = max {
        candidates.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
        let room = max.saturating_sub(kept);
        for (i, e) in candidates.into_iter().enumerate() {
            if i < room {
                out.wanted.push(owner_created(e));
            } else {
                out.excess.push(e.name.clone());
            }
        }
        if kept > max {
            out.over_limit = Some((kept, max));
        }
    }
    out.wanted.sort_by(|a, b| a.name.cmp(&b.name));
    out.excess.sort();
    out.removed.sort_by(|a, b| a.name.cmp(&b.name));
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
            adopted: false,
            adopt_by: None,
            created_for: None,
            admitted: true,
            created: None,
        }
    }

    fn protected() -> Protected {
        Protected {
            names: ["tenant-operator-system".to_string()].into(),
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
            &protected(),
            None,
        )
    }

    #[test]
    fn a_plan_says_what_keeps_listed_namespaces_from_the_tenant() {
        let plan = NamespacePlan {
            conflicts: vec![("shared".into(), "team-b".into())],
            refused: vec![("kube-system".into(), "never a tenant's".into())],
            over_limit: Some((4, 3)),
            wanted: vec![
                Wanted {
                    name: "going".into(),
                    declared: true,
                    exists: true,
                    terminating: true,
                    adopted: false,
                },
                // Not listed: it goes, and is not re-created.
                Wanted {
                    name: "owned".into(),
                    declared: false,
                    exists: true,
                    terminating: true,
                    adopted: false,
                },
            ],
            ..Default::default()
        };
        let reasons: Vec<&str> = plan.problems().iter().map(|p| p.reason).collect();
        assert_eq!(
            reasons,
            [
                "NamespaceConflict",
                "NamespaceNotAdoptable",
                "MaxNamespacesExceeded",
                "NamespaceTerminating"
            ]
        );
        assert!(plan.problems()[3].message.contains("going"));
        assert!(NamespacePlan::default().problems().is_empty());
    }

    #[test]
    fn listed_namespaces_are_created_or_adopted_only_when_handed_over() {
        let mut handed = ns("c", None, false);
        handed.adopt_by = Some("acme".into());
        let mut for_other = ns("d", None, false);
        for_other.adopt_by = Some("other".into());
        let p = run(
            &["a", "b", "c", "d"],
            &[ns("b", None, false), handed, for_other],
        );
        assert_eq!(p.active(), ["a", "c"]);
        assert!(!p.wanted[0].exists && !p.wanted[0].adopted, "a is created");
        assert!(p.wanted[1].exists && p.wanted[1].adopted, "c is adopted");
        let refused: Vec<&str> = p.refused.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            refused,
            ["b", "d"],
            "existing namespaces without the annotation for acme"
        );
        assert!(
            p.refused[0].1.contains("tenancy.steward.dev/adopt-by=acme"),
            "{:?}",
            p.refused
        );
    }

    #[test]
    fn a_namespace_created_for_the_tenant_but_not_labelled_yet_is_its_own() {
        let mut made = ns("a", None, false);
        made.created_for = Some("acme".into());
        let p = run(&["a"], &[made]);
        assert_eq!(p.active(), ["a"]);
        assert!(p.wanted[0].exists && !p.wanted[0].adopted);
    }

    #[test]
    fn system_and_steward_namespaces_are_never_given_even_when_annotated() {
        let mut system = ns("kube-system", None, false);
        system.adopt_by = Some("acme".into());
        let p = run(
            &[
                "default",
                "kube-system",
                "kube-new",
                "tenant-operator-system",
            ],
            &[system],
        );
        assert!(p.wanted.is_empty());
        assert_eq!(p.refused.len(), 4);
        assert!(
            p.refused
                .iter()
                .all(|(_, why)| why.contains("never belongs to a tenant"))
        );
    }

    #[test]
    fn an_adopted_namespace_that_leaves_the_spec_is_removed_as_adopted() {
        let mut adopted = ns("shared", Some("acme"), true);
        adopted.adopted = true;
        let p = run(&[], &[adopted, ns("made", Some("acme"), true)]);
        assert_eq!(
            p.removed,
            [
                Removed {
                    name: "made".into(),
                    adopted: false
                },
                Removed {
                    name: "shared".into(),
                    adopted: true
                },
            ]
        );
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
        assert_eq!(
            p.removed,
            [Removed {
                name: "old".into(),
                adopted: false
            }]
        );
        assert_eq!(p.active(), ["a", "mine"]);
        assert!(!p.wanted.iter().find(|w| w.name == "mine").unwrap().declared);
    }

    /// An owner-created namespace not admitted yet, created `at` seconds into the epoch.
    fn pending(name: &str, at: i64) -> Existing {
        let mut e = ns(name, Some("acme"), false);
        e.admitted = false;
        e.created = Some(Timestamp::from_second(at).unwrap());
        e
    }

    fn run_max(listed: &[&str], existing: &[Existing], max: usize) -> NamespacePlan {
        let listed: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
        plan(
            "acme",
            &listed,
            |n| existing.iter().find(|e| e.name == n).cloned(),
            existing,
            &protected(),
            Some(max),
        )
    }

    #[test]
    fn owner_created_namespaces_beyond_the_limit_are_excess_oldest_kept_first() {
        // max 3: the declared one (not created yet) and the admitted one count first; of the
        // pending ones only the oldest fits, names break ties.
        let p = run_max(
            &["decl"],
            &[
                ns("old", Some("acme"), false),
                pending("z-first", 10),
                pending("b-later", 20),
                pending("a-later", 20),
            ],
            3,
        );
        assert_eq!(p.active(), ["decl", "old", "z-first"]);
        assert_eq!(p.excess, ["a-later", "b-later"]);
        assert_eq!(p.over_limit, None);
        let p = run_max(&[], &[pending("b", 20), pending("a", 20)], 1);
        assert_eq!(
            (p.active(), p.excess),
            (vec!["a".to_string()], vec!["b".to_string()])
        );
    }

    #[test]
    fn admitted_namespaces_are_never_excess_even_over_a_lowered_limit() {
        let p = run_max(
            &["decl"],
            &[
                ns("decl", Some("acme"), true),
                ns("a", Some("acme"), false),
                ns("b", Some("acme"), false),
                pending("c", 1),
            ],
            2,
        );
        assert_eq!(p.active(), ["a", "b", "decl"]);
        assert_eq!(p.excess, ["c"]);
        assert_eq!(p.over_limit, Some((3, 2)));
    }

    #[test]
    fn terminating_owner_namespaces_free_their_place_declared_ones_keep_it() {
        let mut leaving = ns("leaving", Some("acme"), false);
        leaving.terminating = true;
        let mut declared = ns("decl", Some("acme"), true);
        declared.terminating = true;
        let p = run_max(
            &["decl"],
            &[leaving, declared, pending("new", 5), pending("newer", 6)],
            2,
        );
        assert_eq!(p.active(), ["new"]);
        assert_eq!(p.excess, ["newer"]);
        let p = run(&[], &[pending("any", 1), pending("more", 2)]);
        assert!(p.excess.is_empty(), "no limit, no excess");
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

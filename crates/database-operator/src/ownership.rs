//! Who owns a database or role on a PostgreSQL server, recorded on the server itself.
//!
//! Many namespaces and many custom resources can point at one server. So that none of them
//! alters, hands out or drops what another one owns, every database and role this operator
//! creates carries a [`Marker`] in its comment (`COMMENT ON DATABASE` / `COMMENT ON ROLE`,
//! shared catalog objects that only the admin — or, for a database, its owner — can comment
//! on): the kind, namespace, name and UID of the resource that owns it.
//!
//! [`decide`] is the rule, a pure function of what the catalog shows:
//! - an object that does not exist is created and marked;
//! - an object marked for this resource (same kind, namespace and name — a re-created object
//!   of the same name reclaims what its predecessor kept under `Retain`) is managed;
//! - an object marked for *another* resource is refused, naming that resource, unless the
//!   spec opts in with `adopt: true` **and** that resource no longer exists;
//! - an existing object with no marker (made by hand, or by something else) is refused unless
//!   the spec opts in with `adopt: true`;
//! - a privileged role (superuser, CREATEROLE, REPLICATION, BYPASSRLS, or a member of a
//!   `pg_*` role) is never managed.

use std::fmt;

/// The prefix of every marker, so a comment that is not one is recognised as such.
const PREFIX: &str = "steward.dev/owner ";

/// The resource that owns a database or role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Marker {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl Marker {
    /// The marker of the resource `kind` `namespace/name` with `uid`.
    pub fn new(kind: &str, namespace: &str, name: &str, uid: &str) -> Self {
        Self {
            kind: kind.into(),
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    /// The comment text: `steward.dev/owner <kind> <namespace>/<name> <uid>`.
    pub fn render(&self) -> String {
        format!(
            "{PREFIX}{} {}/{} {}",
            self.kind, self.namespace, self.name, self.uid
        )
    }

    /// The marker in `comment`, `None` when the comment is not a marker.
    pub fn parse(comment: &str) -> Option<Self> {
        let rest = comment.strip_prefix(PREFIX)?;
        let mut parts = rest.split(' ');
        let kind = parts.next()?;
        let (namespace, name) = parts.next()?.split_once('/')?;
        let uid = parts.next()?;
        if parts.next().is_some() || [kind, namespace, name, uid].iter().any(|p| p.is_empty()) {
            return None;
        }
        Some(Self::new(kind, namespace, name, uid))
    }

    /// Whether `other` is the same resource identity (kind, namespace and name; a re-created
    /// resource of the same name counts as the same).
    pub fn same_resource(&self, other: &Marker) -> bool {
        self.kind == other.kind && self.namespace == other.namespace && self.name == other.name
    }
}

impl fmt::Display for Marker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
    }
}

/// What the catalog shows about an object (a database or a role).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub exists: bool,
    /// Its comment, if any.
    pub comment: Option<String>,
    /// For roles: superuser, CREATEROLE, REPLICATION, BYPASSRLS or a member of a `pg_*` role.
    pub privileged: bool,
    /// For databases: its owner role carries this resource's marker. `CREATE DATABASE` cannot
    /// run in a transaction with its `COMMENT`, so a crash between the two leaves an unmarked
    /// database owned by this resource's (marked) role: it is this resource's.
    pub owner_marked_for_me: bool,
}

/// What this resource may do with the object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// It does not exist: create it and mark it.
    Create,
    /// It is this resource's: manage it; `remark` when the marker must be (re)written (a
    /// re-created resource, an adopted object).
    Manage { remark: bool },
}

/// Why this resource may not touch the object.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    /// Another resource owns it.
    #[error("{what} is owned by {owner}; it was left untouched")]
    OwnedByAnother { what: String, owner: String },
    /// It exists and no Steward resource owns it.
    #[error(
        "{what} already exists and was not created by this operator; it was left untouched (set adopt: true to take it over)"
    )]
    NotOwned { what: String },
    /// A privileged role is never managed.
    #[error(
        "{what} is a privileged role (superuser, CREATEROLE, REPLICATION, BYPASSRLS or a pg_* member); the operator never manages it"
    )]
    Privileged { what: String },
}

/// Decides whether the resource `me` may manage `what` (e.g. `database "app"`).
/// `owner_exists` is asked only when another resource's marker is found and `adopt` is set:
/// whether that resource still exists.
///
/// # Errors
/// A [`Conflict`] naming the object and, where known, its owner.
pub fn decide(
    what: &str,
    observed: &Observed,
    me: &Marker,
    adopt: bool,
    owner_exists: impl FnOnce(&Marker) -> bool,
) -> Result<Claim, Conflict> {
    if !observed.exists {
        return Ok(Claim::Create);
    }
    if observed.privileged {
        return Err(Conflict::Privileged { what: what.into() });
    }
    match observed.comment.as_deref().and_then(Marker::parse) {
        Some(owner) if owner == *me => Ok(Claim::Manage { remark: false }),
        Some(owner) if owner.same_resource(me) => Ok(Claim::Manage { remark: true }),
        Some(owner) if adopt && !owner_exists(&owner) => Ok(Claim::Manage { remark: true }),
        Some(owner) => Err(Conflict::OwnedByAnother {
            what: what.into(),
            owner: owner.to_string(),
        }),
        None if adopt || observed.owner_marked_for_me => Ok(Claim::Manage { remark: true }),
        None => Err(Conflict::NotOwned { what: what.into() }),
    }
}

/// Whether the resource `me` may drop the object on deletion: only what it owns.
pub fn may_drop(observed: &Observed, me: &Marker) -> bool {
    let marker = observed.comment.as_deref().and_then(Marker::parse);
    observed.exists
        && !observed.privileged
        && match marker {
            Some(owner) => owner.same_resource(me),
            None => observed.owner_marked_for_me,
        }
}

/// Whether `observed` (a role) carries a marker of the resource `me` (any UID).
pub fn marked_for(observed: &Observed, me: &Marker) -> bool {
    observed
        .comment
        .as_deref()
        .and_then(Marker::parse)
        .is_some_and(|owner| owner.same_resource(me))
}

/// Adds the marker statement to `plan` when `claim` needs one. A `CREATE ROLE` and its
/// `COMMENT` go out as one statement string, which PostgreSQL runs as one transaction: a crash
/// can never leave the role unmarked.
pub fn mark(mut plan: Vec<String>, claim: &Claim, comment: String) -> Vec<String> {
    match claim {
        Claim::Manage { remark: false } => {}
        Claim::Create if plan.first().is_some_and(|s| s.starts_with("CREATE ROLE")) => {
            plan[0] = format!("{}; {comment}", plan[0]);
        }
        Claim::Create | Claim::Manage { remark: true } => plan.push(comment),
    }
    plan
}

/// [`decide`] with the API server asked, when needed, whether the resource another marker
/// names still exists (same kind, namespace, name and UID).
///
/// # Errors
/// [`crate::Error::Ownership`] for a conflict; [`crate::Error::Read`] when the lookup fails.
pub async fn claim(
    client: &kube::Client,
    what: &str,
    observed: &Observed,
    me: &Marker,
    adopt: bool,
) -> Result<Claim, crate::Error> {
    let other = observed
        .comment
        .as_deref()
        .and_then(Marker::parse)
        .filter(|m| !m.same_resource(me));
    let other_exists = match (&other, adopt) {
        (Some(m), true) => resource_exists(client, m).await?,
        _ => true,
    };
    Ok(decide(what, observed, me, adopt, |_| other_exists)?)
}

async fn resource_exists(client: &kube::Client, m: &Marker) -> Result<bool, crate::Error> {
    use kube::{Api, ResourceExt};
    let read = |source| crate::Error::Read {
        what: format!("{m} (the owner recorded on the server)"),
        source,
    };
    let uid = match m.kind.as_str() {
        "Database" => Api::<crate::crd::Database>::namespaced(client.clone(), &m.namespace)
            .get_opt(&m.name)
            .await
            .map_err(read)?
            .and_then(|o| o.uid()),
        "DatabaseRole" => Api::<crate::crd::DatabaseRole>::namespaced(client.clone(), &m.namespace)
            .get_opt(&m.name)
            .await
            .map_err(read)?
            .and_then(|o| o.uid()),
        // A kind this operator does not know: assume its owner is alive.
        _ => return Ok(true),
    };
    Ok(uid.as_deref() == Some(m.uid.as_str()))
}

/// Refuses to write Secret `existing` unless this operator created it for `owner`: it carries
/// the owner's UID label ([`steward_core::apply::OWNER_LABEL`]), or, when `same_name_label`
/// names a label and value, it is one this operator made for an earlier object of the same
/// name (a superuser Secret retained with its volumes). A user's Secret that happens to have
/// the name is never modified, adopted or garbage-collected.
///
/// # Errors
/// [`crate::Error::SecretConflict`] naming the Secret.
pub fn ensure_ours<K: kube::Resource>(
    existing: Option<&k8s_openapi::api::core::v1::Secret>,
    owner: &K,
    same_name_label: Option<(&str, &str)>,
) -> Result<(), crate::Error> {
    use kube::ResourceExt;
    let Some(secret) = existing else {
        return Ok(());
    };
    let labels = secret.labels();
    let uid = owner.meta().uid.as_deref().unwrap_or_default();
    let ours = labels
        .get(steward_core::apply::OWNER_LABEL)
        .map(String::as_str)
        == Some(uid);
    let retained = labels
        .get(steward_core::apply::MANAGED_BY_LABEL)
        .map(String::as_str)
        == Some(crate::NAME)
        && same_name_label.is_some_and(|(k, v)| labels.get(k).map(String::as_str) == Some(v))
        && secret.owner_references().is_empty();
    if ours || retained {
        Ok(())
    } else {
        Err(crate::Error::SecretConflict(format!(
            "Secret {} already exists and was not created by this operator for {}; it was left untouched: delete or rename it, or rename this object",
            secret.name_any(),
            owner.name_any()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Marker {
        Marker::new("Database", "team-a", "app", "uid-1")
    }

    fn marked(m: &Marker) -> Observed {
        Observed {
            exists: true,
            comment: Some(m.render()),
            ..Observed::default()
        }
    }

    #[test]
    fn markers_round_trip_and_other_comments_are_not_markers() {
        let m = me();
        assert_eq!(Marker::parse(&m.render()), Some(m));
        for other in [
            "",
            "app database",
            "steward.dev/owner Database team-a app uid",
            "steward.dev/owner Database team-a/app",
            "steward.dev/owner Database team-a/app uid extra",
        ] {
            assert_eq!(Marker::parse(other), None, "{other:?}");
        }
    }

    #[test]
    fn what_does_not_exist_is_created_and_what_is_ours_is_managed() {
        let never = |_: &Marker| panic!("not asked");
        assert_eq!(
            decide("x", &Observed::default(), &me(), false, never),
            Ok(Claim::Create)
        );
        assert_eq!(
            decide("x", &marked(&me()), &me(), false, never),
            Ok(Claim::Manage { remark: false })
        );
        // A re-created resource of the same name reclaims what its predecessor kept.
        let predecessor = Marker::new("Database", "team-a", "app", "uid-0");
        assert_eq!(
            decide("x", &marked(&predecessor), &me(), false, never),
            Ok(Claim::Manage { remark: true })
        );
    }

    #[test]
    fn another_resources_object_is_refused_even_with_adopt_while_it_exists() {
        for other in [
            Marker::new("Database", "team-b", "app", "uid-2"),
            Marker::new("Database", "team-a", "other", "uid-3"),
            Marker::new("DatabaseRole", "team-a", "app", "uid-4"),
        ] {
            let err =
                decide("database \"app\"", &marked(&other), &me(), true, |_| true).unwrap_err();
            assert!(err.to_string().contains(&other.to_string()), "{err}");
            assert!(decide("x", &marked(&other), &me(), false, |_| false).is_err());
            assert_eq!(
                decide("x", &marked(&other), &me(), true, |_| false),
                Ok(Claim::Manage { remark: true }),
                "adopt takes over what a deleted resource left behind"
            );
        }
    }

    #[test]
    fn unmarked_objects_need_adopt_and_privileged_roles_are_never_managed() {
        let plain = Observed {
            exists: true,
            comment: Some("made by hand".into()),
            ..Observed::default()
        };
        assert!(matches!(
            decide("x", &plain, &me(), false, |_| false),
            Err(Conflict::NotOwned { .. })
        ));
        assert_eq!(
            decide("x", &plain, &me(), true, |_| false),
            Ok(Claim::Manage { remark: true })
        );
        let privileged = Observed {
            privileged: true,
            ..marked(&me())
        };
        assert!(matches!(
            decide("x", &privileged, &me(), true, |_| false),
            Err(Conflict::Privileged { .. })
        ));
        assert!(!may_drop(&privileged, &me()));
    }

    #[test]
    fn an_unmarked_database_owned_by_my_marked_role_is_mine() {
        let crashed = Observed {
            exists: true,
            owner_marked_for_me: true,
            ..Observed::default()
        };
        assert_eq!(
            decide("x", &crashed, &me(), false, |_| false),
            Ok(Claim::Manage { remark: true })
        );
        assert!(may_drop(&crashed, &me()));
    }

    #[test]
    fn a_created_role_and_its_marker_are_one_statement() {
        let plan = mark(
            vec!["CREATE ROLE \"r\" WITH LOGIN".into()],
            &Claim::Create,
            "COMMENT ON ROLE \"r\" IS 'm'".into(),
        );
        assert_eq!(
            plan,
            vec!["CREATE ROLE \"r\" WITH LOGIN; COMMENT ON ROLE \"r\" IS 'm'"]
        );
        let plan = mark(vec![], &Claim::Manage { remark: true }, "c".into());
        assert_eq!(plan, vec!["c"]);
        assert!(mark(vec![], &Claim::Manage { remark: false }, "c".into()).is_empty());
    }

    #[test]
    fn only_what_is_ours_is_dropped() {
        assert!(may_drop(&marked(&me()), &me()));
        assert!(!may_drop(
            &marked(&Marker::new("Database", "team-b", "app", "u")),
            &me()
        ));
        assert!(!may_drop(
            &Observed {
                exists: true,
                ..Observed::default()
            },
            &me()
        ));
        assert!(!may_drop(&Observed::default(), &me()));
    }
}

//! What a plan may publish of the values it changes (pure, unit-tested below).
//!
//! A plan's status, its Events and the orchestrator's logs have more readers than its
//! targets: the `view` role reads UpgradePlans and Events, not Secrets. So each component
//! shows its values (the recorded `previous` and `target`, the values in Events, log lines and
//! error messages) only as far as its [`Exposure`] allows:
//!
//! - [`Exposure::Clear`]: an image, a PostgresCluster version, a field under `/spec` of any
//!   kind but a Secret. Configuration, shown as it is.
//! - [`Exposure::Digest`]: a field outside `/spec` (`/data/...`, `/binaryData/...` of a
//!   ConfigMap): shown as `sha256:` and the first 16 hex digits of the SHA-256 of its JSON
//!   text, enough to tell values apart, not to read them.
//! - [`Exposure::Hidden`]: any field of a Secret. Not even a digest (a digest of a short
//!   password is cracked by hashing likely passwords): one of three stand-ins,
//!   [`BEFORE`] (not the plan's value, and the value the plan replaced if it changed it),
//!   [`PLANNED`] (the plan's value) and [`OTHER`] (neither: someone else changed it).
//!
//! The status records those stand-ins where it recorded the values, and the state machine
//! (the upgrade-orchestrator's `progress`) compares them exactly as it compared the values: a change is made
//! while the target shows the recorded `previous`, a component is upgraded when it shows
//! `target`, anything else was changed by someone else.
//!
//! # How a rollback still restores the exact value
//!
//! The value a component replaced is kept on the target itself, in the annotation
//! [`kept_annotation`] (`upgrade.steward.dev/previous-<hash of plan and component>`, holding
//! the JSON text of the previous value, `null` when the field was absent). The JSON patch that
//! changes the field writes it, so it exists exactly when the change was made; the patch that
//! reverts the field tests it, restores the field from it and removes it. It is readable by
//! exactly those who can read the target.
//!
//! Once the plan has succeeded or rolled back (a `rollback: Never` component keeps its new
//! value), the reconcile that records it removes the annotations left.
//!
//! # Caveats
//! - The annotation is on the target while its plan runs (and after it, if its removal
//!   failed, or the orchestrator stopped right before, or the plan ended `Failed`, when a
//!   human may need it): `kubectl describe secret` shows it to whoever may read the Secret.
//! - The plan's own spec holds the new value (`set.value`): whoever reads the plan reads it.
//! - Custom health rules of a Digest or Hidden component see the whole target; their error
//!   messages (which may quote its data) are not shown.

use sha2::{Digest, Sha256};

use crate::Component;

/// How much of a component's values its plan shows. See the module's documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exposure {
    /// As they are.
    Clear,
    /// As a short SHA-256 digest of their JSON text.
    Digest,
    /// Not at all: [`BEFORE`], [`PLANNED`] or [`OTHER`].
    Hidden,
}

/// A Secret's field holds a value the plan did not set: the one it had before (or, once the
/// plan changed it, the one the plan replaced and keeps in [`kept_annotation`]).
pub const BEFORE: &str = "(hidden: the Secret's value before the plan)";
/// A Secret's field holds the plan's value.
pub const PLANNED: &str = "(hidden: the plan's value)";
/// A Secret's field holds neither the plan's value nor the one it replaced.
pub const OTHER: &str = "(hidden: a value set by someone else)";

/// The prefix of the annotation a target keeps a replaced value in.
pub const KEPT_PREFIX: &str = "upgrade.steward.dev/previous-";

/// How much `component` shows of its values: any field of a Secret is [`Exposure::Hidden`],
/// a field outside `/spec` [`Exposure::Digest`], the rest (images, versions, `/spec` fields)
/// [`Exposure::Clear`].
pub fn exposure(component: &Component) -> Exposure {
    let Some(set) = &component.set else {
        return Exposure::Clear;
    };
    if component.target.kind == "Secret" {
        Exposure::Hidden
    } else if set.path == "/spec" || set.path.starts_with("/spec/") {
        Exposure::Clear
    } else {
        Exposure::Digest
    }
}

/// `sha256:` and the first 16 hex digits of the SHA-256 of `text`.
pub fn digest(text: &str) -> String {
    let hash = Sha256::digest(text.as_bytes());
    let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// What a plan shows for a field holding `current` (JSON text), when the plan sets it to
/// `planned` and the target keeps `kept` in [`kept_annotation`] (set once the plan changed it).
pub fn shown(exposure: Exposure, current: &str, planned: &str, kept: Option<&str>) -> String {
    match exposure {
        Exposure::Clear => current.to_string(),
        Exposure::Digest => digest(current),
        Exposure::Hidden if current == planned => PLANNED.to_string(),
        Exposure::Hidden if kept.is_some_and(|k| k != current) => OTHER.to_string(),
        Exposure::Hidden => BEFORE.to_string(),
    }
}

/// The annotation in which a target keeps the value that component `component` of plan
/// `plan` (in `namespace`) replaced: [`KEPT_PREFIX`] and 16 hex digits of a SHA-256 of the
/// three, so it fits the 63 characters of an annotation's name whatever their length.
pub fn kept_annotation(namespace: &str, plan: &str, component: &str) -> String {
    let hash = Sha256::digest(format!("{namespace}/{plan}/{component}").as_bytes());
    let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{KEPT_PREFIX}{hex}")
}

/// `key` as one segment of a JSON pointer (RFC 6901: `~` is `~0`, `/` is `~1`).
pub fn pointer_segment(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FieldChange, TargetKind, TargetRef};
    use serde_json::json;

    fn set(kind: &str, path: &str) -> Component {
        Component {
            name: "c".into(),
            target: TargetRef {
                api_version: Some("v1".into()),
                namespace: None,
                kind: kind.into(),
                name: "t".into(),
            },
            image: None,
            set: Some(FieldChange {
                path: path.into(),
                value: json!("czNjcmV0"),
            }),
            version: None,
            depends_on: vec![],
            rollback: None,
            health: None,
            hooks: None,
        }
    }

    #[test]
    fn secrets_are_hidden_fields_outside_spec_digested_the_rest_clear() {
        assert_eq!(exposure(&set("Secret", "/data/password")), Exposure::Hidden);
        // A Secret has no /spec, but a field of a Secret is hidden wherever it is.
        assert_eq!(exposure(&set("Secret", "/spec/x")), Exposure::Hidden);
        assert_eq!(
            exposure(&set("ConfigMap", "/data/release")),
            Exposure::Digest
        );
        assert_eq!(
            exposure(&set("ConfigMap", "/binaryData/blob")),
            Exposure::Digest
        );
        // `/spec` must be a whole segment: `/specs` is outside it.
        assert_eq!(exposure(&set("Widget", "/specs/x")), Exposure::Digest);
        assert_eq!(exposure(&set("Widget", "/spec/size")), Exposure::Clear);
        assert_eq!(exposure(&set("Widget", "/spec")), Exposure::Clear);
        let mut image = set("Deployment", "/spec/x");
        image.set = None;
        image.target = TargetRef::of(TargetKind::Deployment, "web");
        assert_eq!(exposure(&image), Exposure::Clear);
    }

    #[test]
    fn a_hidden_value_shows_only_which_of_three_it_is() {
        let (old, new) = ("\"aHVudGVyMg==\"", "\"czNjcmV0\"");
        let h = Exposure::Hidden;
        assert_eq!(shown(h, old, new, None), BEFORE);
        assert_eq!(shown(h, "null", new, None), BEFORE, "absent before");
        assert_eq!(shown(h, new, new, None), PLANNED);
        assert_eq!(shown(h, new, new, Some(old)), PLANNED);
        // Once changed, the kept value tells the plan's previous value from someone else's.
        assert_eq!(shown(h, old, new, Some(old)), BEFORE);
        assert_eq!(shown(h, "\"b3RoZXI=\"", new, Some(old)), OTHER);
        for stand_in in [BEFORE, PLANNED, OTHER] {
            assert!(!stand_in.contains("aHVudGVyMg") && !stand_in.contains("czNjcmV0"));
        }
    }

    #[test]
    fn a_digest_tells_values_apart_without_showing_them() {
        let d = shown(Exposure::Digest, "\"1.0\"", "\"2.0\"", None);
        assert_eq!(d, digest("\"1.0\""));
        assert!(
            d.starts_with("sha256:") && d.len() == "sha256:".len() + 16,
            "{d}"
        );
        assert!(!d.contains("1.0"));
        assert_ne!(d, digest("\"2.0\""));
        assert_ne!(digest("\"1.0\""), digest("1.0"), "the JSON type counts");
        assert_eq!(
            shown(Exposure::Clear, "\"1.0\"", "\"2.0\"", None),
            "\"1.0\""
        );
    }

    #[test]
    fn the_kept_annotation_is_a_valid_name_per_plan_and_component() {
        let long = "x".repeat(253);
        let key = kept_annotation("ns", &long, &"c".repeat(63));
        let name = key.strip_prefix("upgrade.steward.dev/").unwrap();
        assert!(name.len() <= 63, "{key}");
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
            "{key}"
        );
        assert_ne!(
            kept_annotation("ns", "a", "c"),
            kept_annotation("ns", "b", "c")
        );
        assert_ne!(
            kept_annotation("ns", "a", "c"),
            kept_annotation("ns", "a", "d")
        );
        assert_ne!(
            kept_annotation("ns", "a", "c"),
            kept_annotation("other", "a", "c")
        );
        assert_eq!(pointer_segment(&key), key.replace('/', "~1"));
        assert_eq!(pointer_segment("a~b/c"), "a~0b~1c");
    }
}

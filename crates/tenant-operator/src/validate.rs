//! Validate: what admission cannot check, and the spec's quantities parsed once (pure).
//!
//! Admission (the CRD schema and its CEL rules) rejects almost every bad spec. What remains is
//! parsing quantities exactly and checking the Tenant was stored under the rules at all.

use std::collections::BTreeMap;

use crate::crd::{QuantityValue, TenantSpec};
use crate::quantity::Milli;

/// The spec, checked, with quantities parsed.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Validated {
    /// `spec.resourceQuota.hard`.
    pub per_namespace: BTreeMap<String, Milli>,
    /// `spec.tenantQuota.hard`.
    pub tenant: BTreeMap<String, Milli>,
}

impl Validated {
    /// Whether the spec limits anything: each namespace then has the ResourceQuota
    /// [`crate::build::QUOTA_NAME`].
    pub fn has_quota(&self) -> bool {
        !self.tenant.is_empty() || !self.per_namespace.is_empty()
    }
}

/// Why a spec cannot be reconciled; waits for the spec to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid spec: {0}")]
pub struct InvalidSpec(pub String);

fn parse(
    field: &str,
    map: &BTreeMap<String, QuantityValue>,
) -> Result<BTreeMap<String, Milli>, InvalidSpec> {
    map.iter()
        .map(|(k, v)| {
            let m = v
                .milli()
                .map_err(|e| InvalidSpec(format!("{field}.{k}: {e}")))?;
            if m < Milli::ZERO {
                return Err(InvalidSpec(format!("{field}.{k}: {} is negative", v.0)));
            }
            Ok((k.clone(), m))
        })
        .collect()
}

/// Checks `spec` and parses its quantities.
///
/// # Errors
/// [`InvalidSpec`] naming the field.
pub fn validate(spec: &TenantSpec) -> Result<Validated, InvalidSpec> {
    if spec.owners.is_empty() {
        return Err(InvalidSpec("owners: at least one owner is required".into()));
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = spec.namespaces.iter().find(|n| !seen.insert(n.as_str())) {
        return Err(InvalidSpec(format!("namespaces: {dup} is listed twice")));
    }
    if let Some(key) = spec
        .policies
        .iter()
        .flat_map(|p| p.node_selector.keys())
        .find(|k| !is_label_key(k))
    {
        return Err(InvalidSpec(format!(
            "policies.nodeSelector: {key:?} is not a label key ([prefix/]name: letters, digits, '-', '_', '.')"
        )));
    }
    for q in &spec.additional_resource_quotas {
        parse(
            &format!("additionalResourceQuotas[{}].hard", q.name),
            &q.hard,
        )?;
    }
    let per_namespace = spec
        .resource_quota
        .as_ref()
        .map(|q| parse("resourceQuota.hard", &q.hard))
        .transpose()?;
    let tenant = spec
        .tenant_quota
        .as_ref()
        .map(|q| parse("tenantQuota.hard", &q.hard))
        .transpose()?;
    if let Some(l) = &spec.limit_range {
        for (i, item) in l.limits.iter().enumerate() {
            for (field, map) in [
                ("default", &item.default),
                ("defaultRequest", &item.default_request),
                ("max", &item.max),
                ("min", &item.min),
            ] {
                parse(&format!("limitRange.limits[{i}].{field}"), map)?;
            }
        }
    }
    Ok(Validated {
        per_namespace: per_namespace.unwrap_or_default(),
        tenant: tenant.unwrap_or_default(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::crd::{QuotaSpec, Subject, SubjectKind};

    fn spec() -> TenantSpec {
        TenantSpec {
            owners: vec![Subject {
                kind: SubjectKind::User,
                name: "alice".into(),
                namespace: None,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn parses_quotas() {
        let mut s = spec();
        s.tenant_quota = Some(QuotaSpec {
            hard: BTreeMap::from([
                ("pods".into(), "10".into()),
                ("requests.cpu".into(), "1500m".into()),
            ]),
        });
        let v = validate(&s).unwrap();
        assert_eq!(v.tenant["pods"], Milli::units(10));
        assert_eq!(v.tenant["requests.cpu"], Milli(1500));
        assert!(v.per_namespace.is_empty());
    }

    #[test]
    fn rejects_what_admission_would() {
        let mut s = spec();
        s.resource_quota = Some(QuotaSpec {
            hard: BTreeMap::from([("pods".into(), "-1".into())]),
        });
        assert!(
            validate(&s)
                .unwrap_err()
                .0
                .contains("resourceQuota.hard.pods")
        );
        let mut s = spec();
        s.tenant_quota = Some(QuotaSpec {
            hard: BTreeMap::from([("cpu".into(), "lots".into())]),
        });
        assert!(validate(&s).is_err());
        let mut s = spec();
        s.namespaces = vec!["a".into(), "a".into()];
        assert!(validate(&s).is_err());
        assert!(validate(&TenantSpec::default()).is_err(), "no owners");
    }
}

/// A label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63 characters
/// of letters, digits, `-`, `_` and `.`, starting and ending alphanumeric.
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let edges = |s: &str| {
        s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.ends_with(|c: char| c.is_ascii_alphanumeric())
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && edges(name)
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && edges(p)
            && p.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.'))
    });
    name_ok && prefix_ok
}

#[cfg(test)]
mod label_key_tests {
    use super::is_label_key;

    #[test]
    fn label_keys_are_told_apart() {
        for good in ["pool", "node.example.com/pool", "a", "team_a.zone-1"] {
            assert!(is_label_key(good), "{good}");
        }
        for bad in [
            "",
            "a,b",
            "a=b",
            "-pool",
            "Example.com/pool",
            "/pool",
            "a/b/c",
            &"x".repeat(64),
        ] {
            assert!(!is_label_key(bad), "{bad}");
        }
    }
}

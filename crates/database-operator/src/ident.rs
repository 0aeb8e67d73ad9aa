//! PostgreSQL identifiers and literals: validation (the same rules as the CRD schema) and
//! quoting.
//!
//! Every identifier the operator puts into SQL goes through [`quote_ident`], every value
//! that cannot be a bind parameter (utility statements such as `CREATE ROLE … PASSWORD`)
//! through [`quote_literal`]. Validation rejects odd names early with a clear message;
//! quoting makes sure that a name which got through anyway is still only a name.

/// The longest identifier PostgreSQL keeps (`NAMEDATALEN - 1` bytes).
pub const MAX_IDENT_BYTES: usize = 63;

/// The schema pattern for database, role and schema names: lower-case letters, digits and
/// underscores, not starting with a digit (so the quoted and unquoted spellings agree).
pub const NAME_PATTERN: &str = "^[a-z_][a-z0-9_]*$";

/// The schema pattern for extension names, which may contain hyphens (`uuid-ossp`).
pub const EXTENSION_PATTERN: &str = "^[a-z_][a-z0-9_-]*$";

/// The schema pattern for server parameter names (`shared_buffers`, `auto_explain.log_min_duration`).
pub const PARAMETER_PATTERN: &str = "^[a-z_][a-z0-9_.]*$";

/// Role names PostgreSQL reserves or that would hand the operator the superuser.
pub const RESERVED_ROLES: &[&str] = &[
    "postgres",
    "public",
    "none",
    "current_user",
    "session_user",
    "current_role",
];

/// Database names that must never be managed (and so never dropped).
pub const RESERVED_DATABASES: &[&str] = &["postgres", "template0", "template1"];

/// What kind of name is being validated (for the message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Database,
    Role,
    Schema,
    Extension,
    Parameter,
}

impl Kind {
    fn noun(self) -> &'static str {
        match self {
            Kind::Database => "database name",
            Kind::Role => "role name",
            Kind::Schema => "schema name",
            Kind::Extension => "extension name",
            Kind::Parameter => "parameter name",
        }
    }
}

/// A name that failed validation, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {noun} {name:?}: {reason}")]
pub struct InvalidName {
    pub noun: &'static str,
    pub name: String,
    pub reason: String,
}

/// Validates `name` as a `kind`, with the same rules as the CRD schema.
///
/// # Errors
/// [`InvalidName`] saying what is wrong.
pub fn validate(kind: Kind, name: &str) -> Result<(), InvalidName> {
    let fail = |reason: String| {
        Err(InvalidName {
            noun: kind.noun(),
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return fail("must not be empty".into());
    }
    if name.len() > MAX_IDENT_BYTES {
        return fail(format!(
            "is {} bytes long; PostgreSQL keeps at most {MAX_IDENT_BYTES}",
            name.len()
        ));
    }
    let extra: &[char] = match kind {
        Kind::Extension => &['-'],
        Kind::Parameter => &['.'],
        _ => &[],
    };
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || extra.contains(&c));
    if !first_ok || !rest_ok {
        let allowed = match kind {
            Kind::Extension => "lower-case letters, digits, '_' and '-'",
            Kind::Parameter => "lower-case letters, digits, '_' and '.'",
            _ => "lower-case letters, digits and '_'",
        };
        return fail(format!(
            "may contain only {allowed}, and must start with a letter or '_'"
        ));
    }
    if matches!(kind, Kind::Role | Kind::Schema) && name.starts_with("pg_") {
        return fail("the prefix pg_ is reserved by PostgreSQL".into());
    }
    if kind == Kind::Role && RESERVED_ROLES.contains(&name) {
        return fail("is reserved".into());
    }
    // Steward's own roles in its clusters (`steward_replication`, `steward_monitor`,
    // `steward_pooler`, whose lookup reads every login role's verifier): a Database or
    // DatabaseRole that took one over (`adopt: true`) could set its password.
    if kind == Kind::Role && name.starts_with("steward_") {
        return fail("the prefix steward_ is reserved for Steward's own roles".into());
    }
    if kind == Kind::Database && RESERVED_DATABASES.contains(&name) {
        return fail("is a system database the operator never manages".into());
    }
    Ok(())
}

/// Quotes an identifier: `my"name` → `"my""name"`. Safe for any input without NUL bytes
/// (NUL bytes, which PostgreSQL rejects anyway, are removed).
pub fn quote_ident(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        match c {
            '"' => out.push_str("\"\""),
            '\0' => {}
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Quotes a string literal the way PostgreSQL's `quote_literal` does: single quotes are
/// doubled, and a literal containing a backslash is written as an escape string `E'…'` with
/// the backslashes doubled, so the result means the same whatever
/// `standard_conforming_strings` is. NUL bytes are removed.
pub fn quote_literal(value: &str) -> String {
    let mut body = String::with_capacity(value.len() + 2);
    let mut backslash = false;
    for c in value.chars() {
        match c {
            '\'' => body.push_str("''"),
            '\\' => {
                backslash = true;
                body.push_str("\\\\");
            }
            '\0' => {}
            c => body.push(c),
        }
    }
    if backslash {
        format!("E'{body}'")
    } else {
        format!("'{body}'")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVIL: &str = "x\"; DROP DATABASE postgres; --";

    #[test]
    fn quote_ident_doubles_quotes() {
        assert_eq!(quote_ident("app"), "\"app\"");
        assert_eq!(quote_ident(EVIL), "\"x\"\"; DROP DATABASE postgres; --\"");
        assert_eq!(quote_ident("a\0b"), "\"ab\"");
        assert_eq!(quote_ident(""), "\"\"");
    }

    #[test]
    fn quote_literal_handles_quotes_and_backslashes() {
        assert_eq!(quote_literal("abc"), "'abc'");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(
            quote_literal("a\\'; DROP ROLE x; --"),
            "E'a\\\\''; DROP ROLE x; --'"
        );
        assert_eq!(quote_literal("x\0y"), "'xy'");
    }

    #[test]
    fn validate_accepts_ordinary_names() {
        for n in ["app", "_x", "app_2", &"a".repeat(63)] {
            validate(Kind::Database, n).unwrap();
            validate(Kind::Role, n).unwrap();
            validate(Kind::Schema, n).unwrap();
        }
        validate(Kind::Extension, "uuid-ossp").unwrap();
        validate(Kind::Parameter, "auto_explain.log_min_duration").unwrap();
    }

    #[test]
    fn validate_rejects_bad_names() {
        let cases: &[(Kind, &str, &str)] = &[
            (Kind::Database, EVIL, "may contain only"),
            (Kind::Role, EVIL, "may contain only"),
            (Kind::Database, "", "empty"),
            (Kind::Database, &"a".repeat(64), "64 bytes"),
            (Kind::Role, "Admin", "may contain only"),
            (Kind::Role, "1abc", "may contain only"),
            (Kind::Role, "pg_monitor", "reserved"),
            (Kind::Role, "postgres", "reserved"),
            (Kind::Role, "public", "reserved"),
            (Kind::Role, "steward_pooler", "reserved for Steward"),
            (Kind::Role, "steward_replication", "reserved for Steward"),
            (Kind::Database, "template1", "system database"),
            (Kind::Schema, "pg_catalog", "reserved"),
            (Kind::Schema, "a-b", "may contain only"),
            (Kind::Extension, "ext;x", "may contain only"),
            (Kind::Database, "é", "may contain only"),
        ];
        for (kind, name, needle) in cases {
            let err = validate(*kind, name).expect_err(name);
            assert!(err.to_string().contains(needle), "{name}: {err}");
        }
    }
}

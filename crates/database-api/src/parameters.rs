//! What `spec.parameters` of a PostgresCluster may hold, decided without PostgreSQL.
//!
//! # How it works
//!
//! Two tables, each used twice:
//!
//! - **What the operator owns** ([`owned`]): the settings the operator and the instance
//!   manager write themselves (where PostgreSQL listens and its files, `include*`, archiving
//!   and recovery, replication and failover, TLS) and the values that would take a guarantee
//!   away (a preloaded library given by path, `wal_level = minimal`, logs written outside the
//!   data directory). The CRD's CEL rules are generated from these tables
//!   ([`admission_rules`]), so the API server refuses them at admission naming the key, and
//!   [`check`] refuses them again in code.
//! - **What PostgreSQL accepts** ([`check_value`]): the values of common parameters, parsed by
//!   PostgreSQL's own rules (booleans and their prefixes, enums in any case with their hidden
//!   spellings, integers and reals with their units and ranges). A value PostgreSQL would
//!   refuse is admitted (the schema cannot know every PostgreSQL major) but refused by the
//!   controller before it writes anything: `Ready=False InvalidParameters` naming the key and
//!   the value, and the ConfigMap and StatefulSet keep the last good configuration, so no
//!   instance restarts onto a file PostgreSQL would reject.
//!
//! # Caveats
//!
//! Parameters missing from [`TABLE`] (extensions' `x.y`, strings, rarely set ones) and unknown
//! names are left to PostgreSQL: a bad one still stops the instances that load it. The table
//! is compared with a real PostgreSQL's `pg_settings` and `ALTER SYSTEM` in the integration
//! tests (`parameter_checks_agree_with_postgresql`). Check hooks that look beyond one value
//! (`max_connections` plus the worker counts above PostgreSQL's limit) are not modelled.

use std::collections::BTreeMap;

use kube::core::{Message, Rule};

/// Settings the operator or the instance manager writes itself: `(key, prefix, why)`. A
/// `prefix` entry covers every key that starts with it, except [`NOT_OWNED`].
pub const OWNED: &[(&str, bool, &str)] = &[
    ("listen_addresses", false, "where PostgreSQL listens"),
    ("port", false, "where PostgreSQL listens"),
    ("unix_socket_", true, "where PostgreSQL listens"),
    ("data_directory", false, "PostgreSQL's files"),
    ("config_file", false, "PostgreSQL's files"),
    ("hba_file", false, "PostgreSQL's files"),
    ("ident_file", false, "PostgreSQL's files"),
    ("external_pid_file", false, "PostgreSQL's files"),
    ("dynamic_library_path", false, "PostgreSQL's files"),
    ("include", false, "the configuration files"),
    ("include_dir", false, "the configuration files"),
    ("include_if_exists", false, "the configuration files"),
    ("archive_", true, "WAL archiving (spec.backup)"),
    ("restore_command", false, "recovery (spec.bootstrap)"),
    ("recovery_", true, "recovery (spec.bootstrap)"),
    ("primary_conninfo", false, "replication"),
    ("primary_slot_name", false, "replication"),
    ("promote_trigger_file", false, "failover"),
    ("hot_standby", false, "replication"),
    (
        "synchronous_standby_names",
        false,
        "spec.synchronousReplicas",
    ),
    ("cluster_name", false, "replication"),
    ("wal_log_hints", false, "pg_rewind, which needs it"),
    ("full_page_writes", false, "pg_rewind, which needs it"),
    ("ssl", false, "TLS"),
    ("ssl_", true, "TLS"),
];

/// Keys under an [`OWNED`] prefix that a cluster may still set: `archive_timeout` (how often
/// an idle primary switches WAL files; the operator's default is 5 min).
pub const NOT_OWNED: &[&str] = &["archive_timeout"];

/// Parameters naming libraries: by name only (PostgreSQL's library directory), never a path.
pub const LIBRARY_KEYS: &[&str] = &[
    "shared_preload_libraries",
    "session_preload_libraries",
    "local_preload_libraries",
    "jit_provider",
];

/// Parameters naming a place PostgreSQL writes files: relative to the data directory, never
/// absolute nor with a `..` segment (a log file written into the operator's configuration
/// directory would be read as configuration).
pub const PATH_KEYS: &[&str] = &["log_directory", "log_filename", "stats_temp_directory"];

/// What the operator or the instance manager sets `key` for, when it does.
pub fn owned(key: &str) -> Option<&'static str> {
    if NOT_OWNED.contains(&key) {
        return None;
    }
    OWNED
        .iter()
        .find(|(k, prefix, _)| {
            if *prefix {
                key.starts_with(k)
            } else {
                key == *k
            }
        })
        .map(|(_, _, why)| *why)
}

/// CEL: whether the key `var` is owned (as [`owned`]).
fn owned_cel(var: &str) -> String {
    let list = |keys: &mut dyn Iterator<Item = &str>| {
        keys.map(|k| format!("'{k}'"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let exact = list(&mut OWNED.iter().filter(|o| !o.1).map(|o| o.0));
    let prefixes = OWNED
        .iter()
        .filter(|o| o.1)
        .map(|o| format!("{var}.startsWith('{}')", o.0))
        .collect::<Vec<_>>()
        .join(" || ");
    let except = list(&mut NOT_OWNED.iter().copied());
    format!("({var} in [{exact}] || (({prefixes}) && !({var} in [{except}])))")
}

fn cel_list(keys: &[&str]) -> String {
    let quoted: Vec<String> = keys.iter().map(|k| format!("'{k}'")).collect();
    format!("[{}]", quoted.join(", "))
}

/// CEL: whether the value of `k` (one of [`PATH_KEYS`]) leaves the data directory.
const PATH_ESCAPES: &str = "(self[k].startsWith('/') || self[k].split('/').exists(s, s == '..'))";

/// The CEL rules of `spec.parameters` that refuse what the operator owns, each naming the
/// first key it refuses (`messageExpression`; a list of them all, `join`ed, is estimated
/// above the API server's cost budget): the CRD carries each of them.
pub fn admission_rules() -> Vec<Rule> {
    vec![
        owned_rule(),
        libraries_rule(),
        paths_rule(),
        wal_level_rule(),
    ]
}

/// CEL: no key the operator owns ([`owned`]).
pub fn owned_rule() -> Rule {
    let owned = owned_cel("k");
    Rule::new(format!("self.all(k, !{owned})")).message(Message::Expression(format!(
        "'spec.parameters.' + self.filter(k, {owned})[0] + ' is managed by the operator, which sets where PostgreSQL listens, its files and includes, WAL archiving and recovery, replication and TLS itself'"
    )))
}

/// CEL: [`LIBRARY_KEYS`] without a `/`.
pub fn libraries_rule() -> Rule {
    let libraries = cel_list(LIBRARY_KEYS);
    Rule::new(format!(
        "{libraries}.all(k, !(k in self) || !self[k].contains('/'))"
    ))
    .message(Message::Expression(format!(
        "'spec.parameters.' + {libraries}.filter(k, k in self && self[k].contains('/'))[0] + ' must name libraries, not paths: they are loaded by name from the library directory of PostgreSQL'"
    )))
}

/// CEL: [`PATH_KEYS`] relative, without `..`.
pub fn paths_rule() -> Rule {
    let paths = cel_list(PATH_KEYS);
    Rule::new(format!("{paths}.all(k, !(k in self) || !{PATH_ESCAPES})")).message(
        Message::Expression(format!(
            "'spec.parameters.' + {paths}.filter(k, k in self && {PATH_ESCAPES})[0] + ' must stay inside the data directory: a relative path without .. segments'"
        )),
    )
}

/// CEL: `wal_level` is not `minimal`.
pub fn wal_level_rule() -> Rule {
    Rule::new("!('wal_level' in self) || self['wal_level'].lowerAscii() != 'minimal'")
        .message("spec.parameters.wal_level: minimal leaves no WAL for replicas and archiving: use replica (the default) or logical")
}

/// Why `key = value` is refused for what the operator owns (the admission rules, in code).
fn refused_by_operator(key: &str, value: &str) -> Option<String> {
    if let Some(why) = owned(key) {
        return Some(format!(
            "{key} is managed by the operator ({why}); remove it from spec.parameters"
        ));
    }
    if LIBRARY_KEYS.contains(&key) && value.contains('/') {
        return Some(format!(
            "{key} = '{value}' names a path: libraries are loaded by name from PostgreSQL's library directory"
        ));
    }
    if PATH_KEYS.contains(&key) && (value.starts_with('/') || value.split('/').any(|s| s == "..")) {
        return Some(format!(
            "{key} = '{value}' leaves the data directory: use a relative path without '..'"
        ));
    }
    if key == "wal_level" && value.eq_ignore_ascii_case("minimal") {
        return Some(
            "wal_level = 'minimal' leaves no WAL for replicas and archiving: use replica or logical"
                .into(),
        );
    }
    None
}

/// Checks every parameter of a cluster on PostgreSQL `version`: what the operator owns, then
/// the values of known parameters ([`check_value`]).
///
/// # Errors
/// Each refused parameter, naming its key and value, joined by `; `.
pub fn check(version: i32, parameters: &BTreeMap<String, String>) -> Result<(), String> {
    let problems: Vec<String> = parameters
        .iter()
        .filter_map(|(k, v)| refused_by_operator(k, v).or_else(|| check_value(version, k, v).err()))
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// The unit of an integer or real parameter, as `pg_settings.unit` spells it, with its size
/// in bytes or milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unit {
    /// No unit: a plain number.
    None,
    /// Memory, counted in this many bytes (`kB` 1024, `8kB` 8192, `MB` 1048576).
    Memory(&'static str, f64),
    /// Time, counted in this many milliseconds (`ms` 1, `s` 1000, `min` 60000).
    Time(&'static str, f64),
}

const KB: Unit = Unit::Memory("kB", 1024.0);
const BLOCKS: Unit = Unit::Memory("8kB", 8192.0);
const MB: Unit = Unit::Memory("MB", 1048576.0);
const MS: Unit = Unit::Time("ms", 1.0);
const S: Unit = Unit::Time("s", 1000.0);
const MIN: Unit = Unit::Time("min", 60000.0);

impl Unit {
    /// As `pg_settings.unit` spells it (`None`: no unit).
    pub fn name(self) -> Option<&'static str> {
        match self {
            Unit::None => None,
            Unit::Memory(name, _) | Unit::Time(name, _) => Some(name),
        }
    }

    /// `amount` of `suffix` in this unit, as PostgreSQL's `convert_to_base_unit` (the units
    /// are case-sensitive; a memory parameter takes only memory units, a time one time units).
    fn convert(self, amount: f64, suffix: &str) -> Option<f64> {
        const MEMORY: &[(&str, f64)] = &[
            ("B", 1.0),
            ("kB", 1024.0),
            ("MB", 1048576.0),
            ("GB", 1073741824.0),
            ("TB", 1099511627776.0),
        ];
        const TIME: &[(&str, f64)] = &[
            ("us", 0.001),
            ("ms", 1.0),
            ("s", 1000.0),
            ("min", 60000.0),
            ("h", 3600000.0),
            ("d", 86400000.0),
        ];
        let (table, base) = match self {
            Unit::None => return None,
            Unit::Memory(_, base) => (MEMORY, base),
            Unit::Time(_, base) => (TIME, base),
        };
        let size = table.iter().find(|(name, _)| *name == suffix)?.1;
        Some(amount * size / base)
    }
}

/// What values a parameter takes, as PostgreSQL parses them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// `on`/`off`, `true`/`false`, `yes`/`no`, `1`/`0` and their unambiguous prefixes, any case.
    Bool,
    /// One of these names, any case; with `true`, also the hidden boolean spellings (`on`,
    /// `off`, `true`, `false`, `yes`, `no`, `1`, `0`) PostgreSQL accepts for such enums.
    Enum(&'static [&'static str], bool),
    /// An integer (decimal, `0x` hex, `0` octal, or a decimal fraction that is rounded) with
    /// an optional unit, within `min..=max` counted in `unit`.
    Int { min: i64, max: i64, unit: Unit },
    /// A real number with an optional unit, within `min..=max` counted in `unit`.
    Real { min: f64, max: f64, unit: Unit },
}

const INT_MAX: i64 = i32::MAX as i64;
/// PostgreSQL's `MAX_BACKENDS`.
const MAX_BACKENDS: i64 = 262143;
const BOOL_ALIASES: &[&str] = &["on", "off", "true", "false", "yes", "no", "1", "0"];
const SERVER_LEVELS: &[&str] = &[
    "debug5", "debug4", "debug3", "debug2", "debug1", "debug", "info", "notice", "warning",
    "error", "log", "fatal", "panic",
];
const CLIENT_LEVELS: &[&str] = &[
    "debug5", "debug4", "debug3", "debug2", "debug1", "debug", "log", "notice", "warning", "error",
    "info",
];

const ISOLATION_LEVELS: &[&str] = &[
    "serializable",
    "repeatable read",
    "read committed",
    "read uncommitted",
];

const fn names(names: &'static [&'static str]) -> Value {
    Value::Enum(names, false)
}

const fn names_or_bool(names: &'static [&'static str]) -> Value {
    Value::Enum(names, true)
}

const fn int(min: i64, max: i64, unit: Unit) -> Value {
    Value::Int { min, max, unit }
}

const fn real(min: f64, max: f64, unit: Unit) -> Value {
    Value::Real { min, max, unit }
}

/// Common parameters: `(name, first major, last major, values)`.
#[rustfmt::skip]
pub const TABLE: &[(&str, i32, i32, Value)] = &[
    // Booleans.
    ("autovacuum", 13, 99, Value::Bool),
    ("check_function_bodies", 13, 99, Value::Bool),
    ("data_sync_retry", 13, 99, Value::Bool),
    ("default_transaction_read_only", 13, 99, Value::Bool),
    ("fsync", 13, 99, Value::Bool),
    ("hot_standby_feedback", 13, 99, Value::Bool),
    ("jit", 13, 99, Value::Bool),
    ("log_checkpoints", 13, 99, Value::Bool),
    // A list of aspects from 18 on.
    ("log_connections", 13, 17, Value::Bool),
    ("log_disconnections", 13, 99, Value::Bool),
    ("log_duration", 13, 99, Value::Bool),
    ("log_hostname", 13, 99, Value::Bool),
    ("log_lock_waits", 13, 99, Value::Bool),
    ("log_replication_commands", 13, 99, Value::Bool),
    ("logging_collector", 13, 99, Value::Bool),
    ("quote_all_identifiers", 13, 99, Value::Bool),
    ("row_security", 13, 99, Value::Bool),
    ("standard_conforming_strings", 13, 99, Value::Bool),
    ("synchronize_seqscans", 13, 99, Value::Bool),
    ("track_activities", 13, 99, Value::Bool),
    ("track_counts", 13, 99, Value::Bool),
    ("track_io_timing", 13, 99, Value::Bool),
    ("track_wal_io_timing", 14, 99, Value::Bool),
    ("wal_compression", 13, 14, Value::Bool),
    ("wal_init_zero", 13, 99, Value::Bool),
    ("wal_recycle", 13, 99, Value::Bool),
    // Enums.
    ("bytea_output", 13, 99, names(&["escape", "hex"])),
    ("client_min_messages", 13, 99, names(CLIENT_LEVELS)),
    ("compute_query_id", 14, 99, names_or_bool(&["auto", "regress"])),
    ("constraint_exclusion", 13, 99, names_or_bool(&["partition"])),
    ("default_toast_compression", 14, 99, names(&["pglz", "lz4"])),
    ("default_transaction_isolation", 13, 99, names(ISOLATION_LEVELS)),
    ("huge_pages", 13, 99, names_or_bool(&["try"])),
    ("intervalstyle", 13, 99, names(&["postgres", "postgres_verbose", "sql_standard", "iso_8601"])),
    ("log_error_verbosity", 13, 99, names(&["terse", "default", "verbose"])),
    ("log_min_error_statement", 13, 99, names(SERVER_LEVELS)),
    ("log_min_messages", 13, 99, names(SERVER_LEVELS)),
    ("log_statement", 13, 99, names(&["none", "ddl", "mod", "all"])),
    ("password_encryption", 13, 13, names(&["md5", "scram-sha-256", "on", "true", "yes", "1"])),
    ("password_encryption", 14, 99, names(&["md5", "scram-sha-256"])),
    ("plan_cache_mode", 13, 99, names(&["auto", "force_generic_plan", "force_custom_plan"])),
    ("session_replication_role", 13, 99, names(&["origin", "replica", "local"])),
    ("synchronous_commit", 13, 99, names_or_bool(&["local", "remote_write", "remote_apply"])),
    ("track_functions", 13, 99, names(&["none", "pl", "all"])),
    ("wal_compression", 15, 99, names_or_bool(&["pglz", "lz4", "zstd"])),
    ("wal_level", 13, 99, names(&["minimal", "replica", "logical", "archive", "hot_standby"])),
    ("wal_sync_method", 13, 99, names(&["fsync", "fdatasync", "open_sync", "open_datasync"])),
    ("xmlbinary", 13, 99, names(&["base64", "hex"])),
    ("xmloption", 13, 99, names(&["content", "document"])),
    // Integers.
    ("archive_timeout", 13, 99, int(0, INT_MAX / 2, S)),
    ("autovacuum_analyze_threshold", 13, 99, int(0, INT_MAX, Unit::None)),
    ("autovacuum_freeze_max_age", 13, 99, int(100000, 2000000000, Unit::None)),
    ("autovacuum_max_workers", 13, 99, int(1, MAX_BACKENDS, Unit::None)),
    ("autovacuum_naptime", 13, 99, int(1, INT_MAX / 1000, S)),
    ("autovacuum_vacuum_threshold", 13, 99, int(0, INT_MAX, Unit::None)),
    ("autovacuum_work_mem", 13, 99, int(-1, INT_MAX, KB)),
    ("bgwriter_delay", 13, 99, int(10, 10000, MS)),
    ("checkpoint_timeout", 13, 99, int(30, 86400, S)),
    ("checkpoint_warning", 13, 99, int(0, INT_MAX, S)),
    ("deadlock_timeout", 13, 99, int(1, INT_MAX, MS)),
    ("default_statistics_target", 13, 99, int(1, 10000, Unit::None)),
    ("effective_cache_size", 13, 99, int(1, INT_MAX, BLOCKS)),
    ("effective_io_concurrency", 13, 99, int(0, 1000, Unit::None)),
    ("idle_in_transaction_session_timeout", 13, 99, int(0, INT_MAX, MS)),
    ("idle_session_timeout", 14, 99, int(0, INT_MAX, MS)),
    ("lock_timeout", 13, 99, int(0, INT_MAX, MS)),
    ("log_autovacuum_min_duration", 13, 99, int(-1, INT_MAX, MS)),
    ("log_min_duration_statement", 13, 99, int(-1, INT_MAX, MS)),
    ("log_rotation_age", 13, 99, int(0, INT_MAX / 60, MIN)),
    ("log_rotation_size", 13, 99, int(0, INT_MAX / 1024, KB)),
    ("log_temp_files", 13, 99, int(-1, INT_MAX, KB)),
    ("maintenance_work_mem", 13, 15, int(1024, INT_MAX, KB)),
    // 64 kB on 17; taken from 16 on so as never to refuse what PostgreSQL takes.
    ("maintenance_work_mem", 16, 99, int(64, INT_MAX, KB)),
    ("max_connections", 13, 99, int(1, MAX_BACKENDS, Unit::None)),
    ("max_locks_per_transaction", 13, 99, int(10, INT_MAX, Unit::None)),
    ("max_parallel_maintenance_workers", 13, 99, int(0, 1024, Unit::None)),
    ("max_parallel_workers", 13, 99, int(0, 1024, Unit::None)),
    ("max_parallel_workers_per_gather", 13, 99, int(0, 1024, Unit::None)),
    ("max_prepared_transactions", 13, 99, int(0, MAX_BACKENDS, Unit::None)),
    ("max_replication_slots", 13, 99, int(0, MAX_BACKENDS, Unit::None)),
    ("max_standby_archive_delay", 13, 99, int(-1, INT_MAX, MS)),
    ("max_standby_streaming_delay", 13, 99, int(-1, INT_MAX, MS)),
    ("max_wal_senders", 13, 99, int(0, MAX_BACKENDS, Unit::None)),
    ("max_wal_size", 13, 99, int(2, INT_MAX, MB)),
    ("max_worker_processes", 13, 99, int(0, MAX_BACKENDS, Unit::None)),
    ("min_wal_size", 13, 99, int(2, INT_MAX, MB)),
    ("reserved_connections", 16, 99, int(0, MAX_BACKENDS, Unit::None)),
    ("shared_buffers", 13, 99, int(16, INT_MAX / 2, BLOCKS)),
    ("statement_timeout", 13, 99, int(0, INT_MAX, MS)),
    ("superuser_reserved_connections", 13, 99, int(0, MAX_BACKENDS, Unit::None)),
    ("tcp_keepalives_count", 13, 99, int(0, INT_MAX, Unit::None)),
    ("tcp_keepalives_idle", 13, 99, int(0, INT_MAX, S)),
    ("tcp_keepalives_interval", 13, 99, int(0, INT_MAX, S)),
    ("temp_buffers", 13, 99, int(100, INT_MAX / 2, BLOCKS)),
    ("temp_file_limit", 13, 99, int(-1, INT_MAX, KB)),
    ("vacuum_cost_limit", 13, 99, int(1, 10000, Unit::None)),
    ("wal_buffers", 13, 99, int(-1, INT_MAX / 8192, BLOCKS)),
    ("wal_keep_size", 13, 99, int(0, INT_MAX, MB)),
    ("wal_receiver_status_interval", 13, 99, int(0, INT_MAX / 1000, S)),
    ("wal_receiver_timeout", 13, 99, int(0, INT_MAX, MS)),
    ("wal_sender_timeout", 13, 99, int(0, INT_MAX, MS)),
    ("wal_writer_delay", 13, 99, int(1, 10000, MS)),
    ("work_mem", 13, 99, int(64, INT_MAX, KB)),
    // Reals.
    ("autovacuum_analyze_scale_factor", 13, 99, real(0.0, 100.0, Unit::None)),
    ("autovacuum_vacuum_cost_delay", 13, 99, real(-1.0, 100.0, MS)),
    ("autovacuum_vacuum_scale_factor", 13, 99, real(0.0, 100.0, Unit::None)),
    ("checkpoint_completion_target", 13, 99, real(0.0, 1.0, Unit::None)),
    ("cpu_index_tuple_cost", 13, 99, real(0.0, f64::MAX, Unit::None)),
    ("cpu_operator_cost", 13, 99, real(0.0, f64::MAX, Unit::None)),
    ("cpu_tuple_cost", 13, 99, real(0.0, f64::MAX, Unit::None)),
    ("jit_above_cost", 13, 99, real(-1.0, f64::MAX, Unit::None)),
    ("random_page_cost", 13, 99, real(0.0, f64::MAX, Unit::None)),
    ("seq_page_cost", 13, 99, real(0.0, f64::MAX, Unit::None)),
    ("vacuum_cost_delay", 13, 99, real(0.0, 100.0, MS)),
];

/// The values `name` takes on PostgreSQL `version`, if the table knows it.
pub fn known(version: i32, name: &str) -> Option<Value> {
    TABLE
        .iter()
        .find(|(n, from, to, _)| *n == name && (*from..=*to).contains(&version))
        .map(|t| t.3)
}

/// Checks `value` of parameter `name` by PostgreSQL's rules, when the table knows `name` on
/// `version` (otherwise it is left to PostgreSQL).
///
/// # Errors
/// Why PostgreSQL would refuse it, naming the key and the value.
pub fn check_value(version: i32, name: &str, value: &str) -> Result<(), String> {
    let Some(kind) = known(version, name) else {
        return Ok(());
    };
    let refused = |why: String| Err(format!("{name} = '{value}' is not valid: {why}"));
    match kind {
        Value::Bool => {
            if parse_bool(value).is_none() {
                return refused("expected on or off".into());
            }
        }
        Value::Enum(names, bools) => {
            let ok = names.iter().any(|n| n.eq_ignore_ascii_case(value))
                || (bools && BOOL_ALIASES.iter().any(|n| n.eq_ignore_ascii_case(value)));
            if !ok {
                let mut names = names.to_vec();
                if bools {
                    names.extend(["on", "off"]);
                }
                return refused(format!("expected one of {}", names.join(", ")));
            }
        }
        Value::Int { min, max, unit } => {
            let Some(n) = parse_number(value, unit, true) else {
                return refused(expected_number("an integer", unit));
            };
            // rint(): halves to even, as PostgreSQL rounds.
            let n = n.round_ties_even();
            let (lo, hi) = (min as f64, max as f64);
            if n < lo || n > hi {
                return refused(range(&min.to_string(), &max.to_string(), unit));
            }
        }
        Value::Real { min, max, unit } => {
            let Some(n) = parse_number(value, unit, false) else {
                return refused(expected_number("a number", unit));
            };
            if n < min || n > max {
                let bound = |b: f64| {
                    if b == f64::MAX {
                        "any".to_string()
                    } else {
                        b.to_string()
                    }
                };
                return refused(range(&bound(min), &bound(max), unit));
            }
        }
    }
    Ok(())
}

fn expected_number(what: &str, unit: Unit) -> String {
    match unit {
        Unit::None => format!("expected {what} without a unit"),
        Unit::Memory(..) => {
            format!("expected {what}, optionally with one of the units B, kB, MB, GB, TB")
        }
        Unit::Time(..) => {
            format!("expected {what}, optionally with one of the units us, ms, s, min, h, d")
        }
    }
}

fn range(min: &str, max: &str, unit: Unit) -> String {
    match unit.name() {
        Some(u) => format!("outside {min} .. {max} (in {u})"),
        None => format!("outside {min} .. {max}"),
    }
}

/// PostgreSQL's `parse_bool`: `on`, `off` (or `of`), any prefix of `true`, `false`, `yes`,
/// `no`, and `1`, `0`, in any case.
pub fn parse_bool(value: &str) -> Option<bool> {
    let v = value.to_ascii_lowercase();
    let prefix_of = |word: &str| !v.is_empty() && word.starts_with(v.as_str());
    match v.as_str() {
        "on" => Some(true),
        "of" | "off" => Some(false),
        "1" => Some(true),
        "0" => Some(false),
        _ if prefix_of("true") || prefix_of("yes") => Some(true),
        _ if prefix_of("false") || prefix_of("no") => Some(false),
        _ => None,
    }
}

/// A number as PostgreSQL's `parse_int` (`integer`: `strtol` with base 0, then `strtod` when
/// a fraction or exponent follows) or `parse_real` (`strtod`) reads it, then optional white
/// space, a unit of `unit`'s kind up to the next white space, and only white space after it;
/// converted to `unit`.
fn parse_number(value: &str, unit: Unit, integer: bool) -> Option<f64> {
    let space = |c: char| c.is_ascii_whitespace();
    let (n, rest) = leading_number(value, integer)?;
    if !n.is_finite() {
        return None;
    }
    let rest = rest.trim_start_matches(space);
    if rest.is_empty() {
        return Some(n);
    }
    let (suffix, after) = rest.split_at(rest.find(space).unwrap_or(rest.len()));
    if !after.trim_start_matches(space).is_empty() {
        return None;
    }
    unit.convert(n, suffix)
}

/// The number at the start of `value` (after white space) and what follows it.
fn leading_number(value: &str, integer: bool) -> Option<(f64, &str)> {
    let s = value.trim_start_matches(|c: char| c.is_ascii_whitespace());
    let (sign, body) = match s.as_bytes().first() {
        Some(b'-') => (-1.0, &s[1..]),
        Some(b'+') => (1.0, &s[1..]),
        _ => (1.0, s),
    };
    // strtol and strtod both read `0x` hex (a hex fraction is not modelled).
    let hex = body
        .strip_prefix("0x")
        .or_else(|| body.strip_prefix("0X"))
        .filter(|h| h.starts_with(|c: char| c.is_ascii_hexdigit()));
    if integer || hex.is_some() {
        // strtol, base 0: `0x` hex, a leading 0 octal (up to the first 8 or 9), else decimal.
        let (digits, radix) = match hex {
            Some(h) => (h, 16),
            None if body.starts_with('0') => (body, 8),
            None => (body, 10),
        };
        let end = digits
            .find(|c: char| !c.is_digit(radix))
            .unwrap_or(digits.len());
        let rest = &digits[end..];
        // A fraction or an exponent: PostgreSQL reads the whole number again with strtod.
        if end > 0 && (radix == 16 || !rest.starts_with(['.', 'e', 'E'])) {
            let n = i64::from_str_radix(&digits[..end], radix).ok()?;
            return Some((sign * n as f64, rest));
        }
    }
    // strtod: digits, an optional fraction, an optional exponent (at least one digit).
    let bytes = body.as_bytes();
    let digits = |i: &mut usize| {
        let start = *i;
        while *i < bytes.len() && bytes[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - start
    };
    let mut i = 0;
    let mut count = digits(&mut i);
    if bytes.get(i) == Some(&b'.') {
        i += 1;
        count += digits(&mut i);
    }
    if count == 0 {
        return None;
    }
    if matches!(bytes.get(i), Some(b'e' | b'E')) {
        let mut j = i + 1;
        if matches!(bytes.get(j), Some(b'+' | b'-')) {
            j += 1;
        }
        if digits(&mut j) > 0 {
            i = j;
        }
    }
    let n: f64 = body[..i].parse().ok()?;
    Some((sign * n, &body[i..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_operators_own_settings_are_refused_naming_the_key() {
        for key in [
            "include",
            "include_dir",
            "include_if_exists",
            "archive_command",
            "archive_mode",
            "archive_library",
            "archive_cleanup_command",
            "restore_command",
            "recovery_target_time",
            "recovery_min_apply_delay",
            "primary_conninfo",
            "primary_slot_name",
            "ssl",
            "ssl_ca_file",
            "ssl_passphrase_command",
            "listen_addresses",
            "port",
            "hba_file",
            "ident_file",
            "data_directory",
            "config_file",
            "unix_socket_directories",
            "unix_socket_permissions",
            "synchronous_standby_names",
            "hot_standby",
            "cluster_name",
            "wal_log_hints",
        ] {
            let err = check(16, &params(&[(key, "x")])).unwrap_err();
            assert!(
                err.starts_with(&format!("{key} is managed by the operator")),
                "{key}: {err}"
            );
        }
        for key in ["archive_timeout", "hot_standby_feedback", "sslx", "portal"] {
            assert_eq!(owned(key), None, "{key}");
        }
    }

    #[test]
    fn libraries_by_name_and_files_inside_the_data_directory() {
        assert!(
            check(
                16,
                &params(&[(
                    "shared_preload_libraries",
                    "pg_stat_statements, auto_explain"
                )])
            )
            .is_ok()
        );
        let err = check(16, &params(&[("shared_preload_libraries", "/tmp/evil.so")])).unwrap_err();
        assert!(
            err.contains("shared_preload_libraries = '/tmp/evil.so' names a path"),
            "{err}"
        );
        assert!(check(16, &params(&[("jit_provider", "$libdir/x")])).is_err());
        assert!(
            check(
                16,
                &params(&[("log_directory", "log"), ("log_filename", "pg-%a.log")])
            )
            .is_ok()
        );
        for (k, v) in [
            ("log_directory", "/steward/run"),
            ("log_directory", "../x"),
            ("log_filename", "../../steward/run/defaults.conf"),
        ] {
            let err = check(16, &params(&[(k, v)])).unwrap_err();
            assert!(
                err.contains(k) && err.contains("leaves the data directory"),
                "{err}"
            );
        }
        assert!(check(16, &params(&[("wal_level", "Minimal")])).is_err());
        assert!(check(16, &params(&[("wal_level", "logical")])).is_ok());
    }

    /// Issue #39, item 5: `log_statement: bogus` was admitted and took the cluster down.
    #[test]
    fn an_unknown_enum_value_is_refused_naming_key_and_value() {
        let err = check(16, &params(&[("log_statement", "bogus")])).unwrap_err();
        assert_eq!(
            err,
            "log_statement = 'bogus' is not valid: expected one of none, ddl, mod, all"
        );
        assert!(check_value(16, "log_statement", "ALL").is_ok(), "any case");
        assert!(check_value(16, "synchronous_commit", "remote_apply").is_ok());
        assert!(
            check_value(16, "synchronous_commit", "yes").is_ok(),
            "hidden spelling"
        );
        assert!(
            check_value(16, "synchronous_commit", "y").is_err(),
            "no prefixes for enums"
        );
        assert!(
            check_value(14, "wal_compression", "zstd").is_err(),
            "a boolean before 15"
        );
        assert!(check_value(14, "wal_compression", "tr").is_ok());
        assert!(check_value(15, "wal_compression", "zstd").is_ok());
        assert!(check_value(16, "default_transaction_isolation", "Read Committed").is_ok());
        assert!(check_value(16, "unknown_to_the_table", "anything").is_ok());
        assert!(check_value(16, "auto_explain.log_min_duration", "x").is_ok());
    }

    #[test]
    fn booleans_take_postgresqls_spellings() {
        for v in [
            "on", "OFF", "of", "t", "TRUE", "y", "ye", "no", "n", "f", "fal", "1", "0",
        ] {
            assert!(parse_bool(v).is_some(), "{v}");
        }
        for v in ["o", "", "2", "enabled", "on ", "yess"] {
            assert!(parse_bool(v).is_none(), "{v}");
        }
    }

    #[test]
    fn integers_take_units_of_their_kind_and_stay_in_range() {
        let ok = |k: &str, v: &str| check_value(16, k, v).is_ok();
        assert!(ok("shared_buffers", "128MB"));
        assert!(ok("shared_buffers", "16384"));
        assert!(ok("shared_buffers", " 1 GB "));
        assert!(ok("shared_buffers", "0.5GB"));
        assert!(!ok("shared_buffers", "128mb"), "units are case-sensitive");
        assert!(!ok("shared_buffers", "128 MB x"));
        assert!(!ok("shared_buffers", "100kB"), "below 16 blocks");
        assert!(!ok("shared_buffers", "10s"), "a time unit for memory");
        assert!(!ok("shared_buffers", "lots"));
        assert!(ok("work_mem", "64kB"));
        assert!(!ok("work_mem", "63kB"));
        assert!(ok("statement_timeout", "5min"));
        assert!(ok("statement_timeout", "0"));
        assert!(ok("statement_timeout", "1.5s"));
        assert!(!ok("statement_timeout", "-1"));
        assert!(!ok("statement_timeout", "5MB"));
        assert!(ok("log_min_duration_statement", "-1"));
        assert!(ok("max_connections", "0x64"), "hex");
        assert!(ok("max_connections", "010"), "octal");
        assert!(!ok("max_connections", "08"), "8 is not octal");
        assert!(!ok("max_connections", "0"));
        assert!(!ok("max_connections", "100 connections"));
        assert!(!ok("max_connections", "10kB"), "no unit for a count");
        assert!(ok("max_connections", "1e2"));
        assert!(ok("checkpoint_timeout", "1h"));
        assert!(!ok("checkpoint_timeout", "2d"), "above 86400 s");
        assert!(!ok("checkpoint_timeout", "29s"));
        let err = check_value(16, "checkpoint_timeout", "29s").unwrap_err();
        assert_eq!(
            err,
            "checkpoint_timeout = '29s' is not valid: outside 30 .. 86400 (in s)"
        );
    }

    #[test]
    fn reals_take_fractions_and_stay_in_range() {
        assert!(check_value(16, "random_page_cost", "1.1").is_ok());
        assert!(check_value(16, "random_page_cost", "1e3").is_ok());
        assert!(check_value(16, "random_page_cost", "-1").is_err());
        assert!(check_value(16, "checkpoint_completion_target", "0.9").is_ok());
        assert!(check_value(16, "checkpoint_completion_target", "1.5").is_err());
        assert!(check_value(16, "vacuum_cost_delay", "2ms").is_ok());
        assert!(
            check_value(16, "vacuum_cost_delay", "2s").is_err(),
            "above 100 ms"
        );
        assert!(check_value(16, "random_page_cost", "nan").is_err());
    }

    #[test]
    fn every_problem_is_named() {
        let err = check(
            16,
            &params(&[
                ("log_statement", "bogus"),
                ("ssl", "off"),
                ("work_mem", "4MB"),
            ]),
        )
        .unwrap_err();
        assert!(
            err.contains("log_statement = 'bogus'") && err.contains("ssl is managed"),
            "{err}"
        );
        assert!(!err.contains("work_mem"), "{err}");
    }

    #[test]
    fn the_admission_rules_are_generated_from_the_same_tables() {
        let rules = admission_rules();
        let owned = &rules[0].rule;
        assert!(
            owned.starts_with("self.all(k, !(k in ['listen_addresses', 'port', "),
            "{owned}"
        );
        assert!(
            owned.contains("k.startsWith('archive_')")
                && owned.contains("!(k in ['archive_timeout'])"),
            "{owned}"
        );
        assert!(rules[1].rule.contains("'shared_preload_libraries'"));
        assert!(rules[2].rule.contains("'log_directory'"));
    }
}

//! Files the instance manager writes for PostgreSQL, rendered without touching the disk.
//!
//! The operator's `postgresql.conf` (a ConfigMap) ends with
//! `include_if_exists = '<run dir>/instance.conf'`: the part that depends on this instance's
//! role, which the manager rewrites and reloads when the primary changes.

use std::path::Path;

use crate::contract::{PG_PORT, REPLICATION_USER};

/// `instance.conf` for a replica streaming from `primary_host` as [`REPLICATION_USER`], its
/// password read from `passfile` (never written into a setting), over TLS verified against
/// the cluster's CA `ca_file` (the primary's certificate names the Services, not pod
/// addresses, so `verify-ca`). With `archive` (the manager's executable, when the cluster
/// archives WAL), a replica that fell behind further than the primary keeps WAL
/// (`wal_keep_size`) catches up from the cluster's own archive (`exe wal-fetch`, which gives
/// up quickly so PostgreSQL goes back to streaming) instead of never catching up.
pub fn replica_conf(
    primary_host: &str,
    application_name: &str,
    passfile: &Path,
    ca_file: &Path,
    archive: Option<(&Path, Archive)>,
) -> String {
    let conninfo = format!(
        "host={primary_host} port={PG_PORT} user={REPLICATION_USER} passfile={} application_name={application_name} connect_timeout=5 sslmode=verify-ca sslrootcert={}",
        passfile.display(),
        ca_file.display()
    );
    let mut out = format!(
        "# Managed by steward-pg-instance: this instance is a replica.\nprimary_conninfo = {}\n",
        quote(&conninfo)
    );
    if let Some((exe, from)) = archive {
        out.push_str(&format!(
            "restore_command = {}\n",
            quote(&fetch_command(exe, from))
        ));
    }
    out.push_str("recovery_target_timeline = 'latest'\n");
    out
}

/// The `restore_command` that fetches WAL with `exe wal-fetch`: from the store the cluster
/// is restored from (`from_recovery`), else from its own archive.
/// Which store a `restore_command` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Archive {
    /// The cluster's own archive (`spec.backup`).
    Own,
    /// The backup a new cluster restores (`spec.bootstrap.recovery`).
    Recovery,
    /// The cluster a standby cluster follows (`spec.replica.source`).
    Source,
}

fn fetch_command(exe: &Path, from: Archive) -> String {
    let from = match from {
        Archive::Own => "",
        Archive::Recovery => " --from-recovery",
        Archive::Source => " --from-source",
    };
    format!("{} wal-fetch{from} %f %p", exe.display())
}

/// `instance.conf` of a standby cluster's leader: it replays its source's archive as the
/// files arrive (with `standby.signal`: it never ends recovery on its own), onto the newest
/// timeline the source's archive has.
pub fn standby_leader_conf(exe: &Path) -> String {
    format!(
        "# Managed by steward-pg-instance: this instance leads a standby cluster, following its source's archive.\n\
         restore_command = {}\n\
         recovery_target_timeline = 'latest'\n",
        quote(&fetch_command(exe, Archive::Source))
    )
}

pub use crate::contract::RESERVED_CONNECTIONS;

/// `defaults.conf`: what this instance manager sets for its PostgreSQL major, included by the
/// operator's `postgresql.conf` before `spec.parameters` (which may override it). `major` is
/// the image's (`None`: unknown, nothing version-specific).
pub fn defaults_conf(major: Option<u32>) -> String {
    let mut out = String::from(
        "# Managed by steward-pg-instance: defaults for this PostgreSQL major (spec.parameters override them).\n",
    );
    if major.is_some_and(|m| m >= 16) {
        out.push_str(&format!("reserved_connections = {RESERVED_CONNECTIONS}\n"));
    }
    out
}

/// `instance.conf` for the primary.
pub fn primary_conf() -> String {
    "# Managed by steward-pg-instance: this instance is the primary.\n".to_string()
}

/// `instance.conf` while the first instance of a restored cluster replays the archive:
/// WAL comes from the source cluster's object store through `exe wal-fetch`, up to
/// `target_time` (RFC 3339) or the end of the archive, then PostgreSQL promotes itself.
pub fn recovery_conf(exe: &Path, target_time: Option<&str>) -> String {
    let mut out =
        String::from("# Managed by steward-pg-instance: restoring this cluster from a backup.\n");
    out.push_str(&format!(
        "restore_command = {}\n",
        quote(&fetch_command(exe, Archive::Recovery))
    ));
    out.push_str("recovery_target_timeline = 'latest'\n");
    if let Some(t) = target_time {
        out.push_str(&format!("recovery_target_time = {}\n", quote(t)));
        out.push_str("recovery_target_inclusive = on\n");
    }
    out.push_str("recovery_target_action = 'promote'\n");
    out
}

/// A `.pgpass` line for [`REPLICATION_USER`] on any host (`:` and `\` escaped).
pub fn pgpass(password: &str) -> String {
    let escaped = password.replace('\\', "\\\\").replace(':', "\\:");
    format!("*:*:*:{REPLICATION_USER}:{escaped}\n")
}

/// A `postgresql.conf` string literal (quotes doubled, backslashes doubled).
fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_streams_as_the_replication_role_with_a_passfile_over_verified_tls() {
        let conf = replica_conf(
            "198.18.0.7",
            "pg-1",
            Path::new("/steward/run/pgpass"),
            Path::new("/tls/ca.crt"),
            None,
        );
        assert_eq!(
            conf,
            "# Managed by steward-pg-instance: this instance is a replica.\n\
             primary_conninfo = 'host=198.18.0.7 port=5432 user=steward_replication passfile=/steward/run/pgpass application_name=pg-1 connect_timeout=5 sslmode=verify-ca sslrootcert=/tls/ca.crt'\n\
             recovery_target_timeline = 'latest'\n"
        );
        assert!(!conf.contains("password"));
    }

    /// Issue #37, item 5: a replica further behind than `wal_keep_size` looped for ever.
    #[test]
    fn a_replica_of_an_archiving_cluster_catches_up_from_its_own_archive() {
        let conf = replica_conf(
            "198.18.0.7",
            "pg-1",
            Path::new("/steward/run/pgpass"),
            Path::new("/tls/ca.crt"),
            Some((Path::new("/steward/bin/steward-pg-instance"), Archive::Own)),
        );
        assert!(
            conf.contains(
                "\nrestore_command = '/steward/bin/steward-pg-instance wal-fetch %f %p'\n"
            ),
            "{conf}"
        );
        assert!(!conf.contains("--from-recovery"));
    }

    #[test]
    fn a_restore_replays_the_source_archive_to_its_target_and_promotes() {
        let conf = recovery_conf(
            Path::new("/steward/bin/steward-pg-instance"),
            Some("2026-12-02T03:00:00Z"),
        );
        assert_eq!(
            conf,
            "# Managed by steward-pg-instance: restoring this cluster from a backup.\n\
             restore_command = '/steward/bin/steward-pg-instance wal-fetch --from-recovery %f %p'\n\
             recovery_target_timeline = 'latest'\n\
             recovery_target_time = '2026-12-02T03:00:00Z'\n\
             recovery_target_inclusive = on\n\
             recovery_target_action = 'promote'\n"
        );
        assert!(!recovery_conf(Path::new("/x"), None).contains("recovery_target_time ="));
    }

    /// Issue #37, item 10: clients filling `max_connections` locked the replication role out
    /// (`pg_rewind`: too many clients already). PostgreSQL 15 has no `reserved_connections`
    /// and would refuse to start with it.
    #[test]
    fn a_standby_leader_replays_its_source_s_archive_and_never_promotes_on_its_own() {
        let conf = standby_leader_conf(Path::new("/steward/bin/steward-pg-instance"));
        assert!(
            conf.contains(
                "\nrestore_command = '/steward/bin/steward-pg-instance wal-fetch --from-source %f %p'\n"
            ),
            "{conf}"
        );
        assert!(conf.contains("\nrecovery_target_timeline = 'latest'\n"));
        assert!(!conf.contains("primary_conninfo"));
        assert!(!conf.contains("recovery_target_action"));
    }

    #[test]
    fn connections_are_reserved_for_the_replication_role_from_postgresql_16_on() {
        assert!(defaults_conf(Some(17)).contains("\nreserved_connections = 3\n"));
        assert!(defaults_conf(Some(16)).contains("reserved_connections"));
        assert!(!defaults_conf(Some(15)).contains("reserved_connections"));
        assert!(!defaults_conf(None).contains("reserved_connections"));
    }

    #[test]
    fn pgpass_escapes_separators() {
        assert_eq!(pgpass("a:b\\c"), "*:*:*:steward_replication:a\\:b\\\\c\n");
    }
}

//! `docs/benchmarks.md` (tables, goals, environment) and `docs/benchmarks.json` (raw numbers).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use super::workload::median_max;
use super::{Measured, Results};

#[derive(Clone, Debug, Serialize)]
pub struct Environment {
    pub cpu: String,
    pub cores: usize,
    pub memory_bytes: u64,
    pub kernel: String,
    pub kubernetes: String,
    pub etcd: String,
    pub kwok: String,
    pub go: String,
    pub rustc: String,
    pub kube_rs: String,
    pub controller_runtime: String,
}

fn command_line(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

pub fn environment(root: &Path, binaries: &steward_testenv::Binaries) -> Environment {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).unwrap_or_default();
    let gomod = std::fs::read_to_string(root.join("bench/reference-tenant-controller/go.mod"))
        .unwrap_or_default();
    Environment {
        cpu: cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .unwrap_or("")
            .trim()
            .to_string(),
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        memory_bytes: meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        kubernetes: binaries.versions.kubernetes.clone(),
        etcd: binaries.versions.etcd.clone(),
        kwok: binaries.versions.kwok.clone(),
        go: command_line("go", &["env", "GOVERSION"]),
        rustc: command_line("rustc", &["--version"]),
        kube_rs: lock
            .split("[[package]]")
            .find(|p| p.contains("name = \"kube\"\n"))
            .and_then(|p| p.lines().find(|l| l.starts_with("version")))
            .map(|l| {
                l.trim_start_matches("version = ")
                    .trim_matches('"')
                    .to_string()
            })
            .unwrap_or_default(),
        controller_runtime: gomod
            .lines()
            .find(|l| l.contains("sigs.k8s.io/controller-runtime "))
            .and_then(|l| l.split_whitespace().last())
            .unwrap_or_default()
            .to_string(),
    }
}

/// Scenario 7: the tenant-operator with three shards on three replicas.
fn sharded_section(md: &mut String, r: &Results) -> Result<()> {
    writeln!(md, "## 7. Scale-out: shards on replicas\n")?;
    let s = match &r.sharded {
        Ok(s) => s,
        Err(e) => {
            writeln!(md, "{e}\n")?;
            return Ok(());
        }
    };
    writeln!(
        md,
        "The tenant-operator with `--shards {0}` on {1} replicas (each holds one shard's Lease; `steward_core::shard`), {2} Tenants, leases {3:.0}/{4:.0}/{5:.0} s. \
        Latency: a Tenant's spec changed → its new generation observed and Ready, one change at a time. During a failover the replica holding a shard gets SIGKILL; \
        changes are then made on Tenants of the other shards until the dead shard's Lease is held again. The killed replica is restarted (and the shards rebalanced) before the next repetition.\n",
        s.shards, s.replicas, s.tenants, s.lease[0], s.lease[1], s.lease[2]
    )?;
    let rss: Vec<String> = s.rss_bytes.iter().map(|b| mib(*b)).collect();
    writeln!(md, "| measure | value |\n|---|---|")?;
    writeln!(md, "| convergence | {:.2} s |", s.convergence_secs)?;
    writeln!(md, "| RSS per replica | {} |", rss.join(", "))?;
    let p = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        (
            super::workload::percentile(&v, 50.0),
            super::workload::percentile(&v, 99.0),
            v.len(),
        )
    };
    let (m, x, k) = p(&s.steady_latency_secs);
    writeln!(
        md,
        "| change latency, steady: p50 / p99 | {m:.3} / {x:.3} s (n={k}) |"
    )?;
    let (m, x, k) = p(&s.failover_latency_secs);
    writeln!(
        md,
        "| change latency on healthy shards during a failover: p50 / p99 | {m:.3} / {x:.3} s (n={k}) |"
    )?;
    let (m, x) = median_max(&s.takeover_secs);
    writeln!(
        md,
        "| SIGKILL → dead shard's Lease acquired: median / max | {m:.2} / {x:.2} s |"
    )?;
    let (m, x) = median_max(&s.dead_shard_reconciled_secs);
    writeln!(
        md,
        "| SIGKILL → a changed Tenant of the dead shard reconciled: median / max | {m:.2} / {x:.2} s |\n"
    )?;
    Ok(())
}

/// Scenario 8: the database-operator with three shards on three replicas.
fn db_sharded_section(md: &mut String, r: &Results) -> Result<()> {
    writeln!(md, "## 8. Scale-out: the database-operator's shards\n")?;
    let d = match &r.db_sharded {
        Ok(d) => d,
        Err(e) => {
            writeln!(md, "{e}\n")?;
            return Ok(());
        }
    };
    writeln!(
        md,
        "The database-operator with `--shards {0}` on {1} replicas, {2} Databases and {3} DatabaseRoles (`crates/bench/src/db_sharded.rs`). \
        The Databases are spread over {4} external PostgreSQL servers (each its own process and port, so its own shard key `external:<host>:<port>`); \
        a DatabaseRole follows its Database. \
        Writers: the replicas whose sessions (PostgreSQL's log, `application_name`) ran statements naming a shard's objects; the holder: of the shard's Lease after convergence.\n",
        d.shards, d.replicas, d.databases, d.roles, d.servers
    )?;
    let rss: Vec<String> = d.rss_bytes.iter().map(|b| mib(*b)).collect();
    writeln!(md, "| measure | value |\n|---|---|")?;
    writeln!(
        md,
        "| created → every Database and DatabaseRole Ready | {:.2} s |",
        d.convergence_secs
    )?;
    writeln!(md, "| RSS per replica | {} |\n", rss.join(", "))?;
    writeln!(
        md,
        "| shard | servers | Databases | Lease holder | writers |\n|---|---|---|---|---|"
    )?;
    for s in &d.per_shard {
        let writers: Vec<&str> = s.writers.iter().map(String::as_str).collect();
        writeln!(
            md,
            "| {} | {} | {} | {} | {} |",
            s.shard,
            s.servers,
            s.databases,
            s.holder.as_deref().unwrap_or("none"),
            if writers.is_empty() {
                "none".to_string()
            } else {
                writers.join(", ")
            }
        )?;
    }
    writeln!(md)?;
    Ok(())
}

/// The goal rows of scenario 7.
fn sharded_goals(md: &mut String, r: &Results) -> Result<()> {
    let Ok(s) = &r.sharded else {
        writeln!(
            md,
            "| {0} shards on {0} replicas | not measured | |",
            super::sharded::SHARDS
        )?;
        return Ok(());
    };
    if let (Some(single), Some(max)) = (
        find(r, "steward", s.tenants).and_then(|m| m.rss_bytes),
        s.rss_bytes.iter().max(),
    ) {
        let ratio = *max as f64 / single as f64;
        writeln!(
            md,
            "| {} Tenants, {} shards: per-replica RSS ≤ 0.4 × the single leader's | max {} vs {} = {ratio:.2}× | {} |",
            s.tenants,
            s.shards,
            mib(*max),
            mib(single),
            verdict(ratio <= 0.4)
        )?;
    }
    let sorted = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        super::workload::percentile(&v, 99.0)
    };
    let (steady, during) = (
        sorted(&s.steady_latency_secs),
        sorted(&s.failover_latency_secs),
    );
    writeln!(
        md,
        "| healthy shards unaffected by a replica's SIGKILL (p99 change latency) | {during:.3} s during vs {steady:.3} s steady | {} |",
        // "Unchanged": within a 100 ms or 50 % margin of the steady p99 on this 2-core machine.
        verdict(during <= (steady * 1.5).max(steady + 0.1))
    )?;
    let (_, x) = median_max(&s.takeover_secs);
    writeln!(
        md,
        "| dead replica's shard taken over ≤ LeaseDuration + RetryPeriod ({:.1} s) | max {x:.2} s | {} |",
        s.lease[0] + s.lease[2],
        verdict(x <= s.lease[0] + s.lease[2])
    )?;
    Ok(())
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / 1048576.0)
}

/// What an idle window's writes include besides the operator's: the namespace controller's
/// deletes in the namespaces still being deleted when it began.
fn overlapped(w: &super::idle::IdleWrites) -> String {
    if w.overlapped.is_empty() {
        String::new()
    } else {
        format!(
            " (the window began with {} namespace(s) still being deleted: the namespace controller's deletes there are counted)",
            w.overlapped.len()
        )
    }
}

/// What the tenant-operator's stores hold at `tenants` Tenants, by kind and part.
fn cache_table(md: &mut String, tenants: usize, kinds: &[super::cache::Kind]) -> Result<()> {
    let names = super::cache::PARTS.map(|(name, _)| name);
    writeln!(
        md,
        "\nWhat the tenant-operator's stores hold at {tenants} Tenants: the Rust heap of each cached object once deserialized (bytes requested from the allocator, counted by the harness's global allocator; see `crates/bench/src/cache.rs`), as the API server sends it and as the store keeps it (`steward_core::controller::trim`med; only the metadata of the kinds the operator watches as metadata); a part's cost is what removing it saves (`required`: the type cannot be read without it).\n"
    )?;
    writeln!(
        md,
        "| kind (selector) | objects | heap as sent | allocations | stored | {} |\n|---|---|---|---|---|{}",
        names.join(" | "),
        "---|".repeat(names.len())
    )?;
    let sum = |f: &dyn Fn(&super::cache::Kind) -> u64| kinds.iter().map(f).sum::<u64>();
    let part = |k: &super::cache::Kind, p: &str| k.parts.get(p).copied().unwrap_or(Some(0));
    for k in kinds.iter().filter(|k| k.objects > 0) {
        let parts: Vec<String> = names
            .iter()
            .map(|p| part(k, p).map_or_else(|| "required".to_string(), mib))
            .collect();
        let selector = if k.selector.is_empty() {
            "all"
        } else {
            &k.selector
        };
        writeln!(
            md,
            "| {} ({selector}) | {} | {} | {} | {} | {} |",
            k.kind,
            k.objects,
            mib(k.bytes),
            k.allocations,
            mib(k.trimmed_bytes),
            parts.join(" | ")
        )?;
    }
    let parts: Vec<String> = names
        .iter()
        .map(|p| {
            let measured = kinds.iter().filter(|k| part(k, p).is_some()).count();
            let total = mib(sum(&|k| part(k, p).unwrap_or(0)));
            if measured == kinds.len() {
                total
            } else {
                format!("≥ {total}")
            }
        })
        .collect();
    writeln!(
        md,
        "| **all** | {} | {} | {} | {} | {} |",
        sum(&|k| k.objects),
        mib(sum(&|k| k.bytes)),
        sum(&|k| k.allocations),
        mib(sum(&|k| k.trimmed_bytes)),
        parts.join(" | ")
    )?;
    Ok(())
}

fn find<'a>(r: &'a Results, subject: &str, n: usize) -> Option<&'a Measured> {
    r.runs
        .iter()
        .find(|m| m.subject == subject && m.tenants == n)
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "**not met**" }
}

pub fn write(out: &Path, r: &Results) -> Result<()> {
    std::fs::create_dir_all(out)?;
    std::fs::write(
        out.join("benchmarks.json"),
        serde_json::to_string_pretty(r)? + "\n",
    )?;
    let mut md = String::new();
    let e = &r.environment;
    let a = &r.args;
    writeln!(
        md,
        "<!-- generated by `cargo xtask bench{}`, do not edit -->",
        if a.smoke { " --smoke" } else { "" }
    )?;
    writeln!(md, "# Benchmarks\n")?;
    writeln!(
        md,
        "Steward's tenant-operator against a minimal controller-runtime implementation of the same Tenant reconcile \
         (`bench/reference-tenant-controller`) and a raw-write floor (the harness writing the same objects itself), \
         in one run on one local control plane. Raw numbers: [`benchmarks.json`](benchmarks.json). \
         Regenerate with `cargo xtask bench` (`--smoke` for the tiny configuration).\n"
    )?;
    if a.tenants.iter().any(|&n| n >= super::FRESH_CLUSTER_AT) {
        writeln!(
            md,
            "From {} Tenants on, each subject (and the sharded scenario) ran on a control plane of its own, \
             started the same way with the same unrelated objects: deleting that many namespaces between subjects \
             takes the namespace controller tens of minutes here, and would load the next subject's window.\n",
            super::FRESH_CLUSTER_AT
        )?;
    }
    if a.smoke {
        writeln!(
            md,
            "> **Smoke configuration** ({} Tenants, {} failovers, {:?} idle window, shortened leases): these numbers only show that the harness works.\n",
            a.tenants
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(","),
            a.failovers,
            a.idle
        )?;
    }
    writeln!(md, "## Machine and versions\n")?;
    writeln!(md, "| | |\n|---|---|")?;
    writeln!(md, "| CPU | {} ({} cores) |", e.cpu, e.cores)?;
    writeln!(md, "| memory | {} |", mib(e.memory_bytes))?;
    writeln!(md, "| kernel | {} |", e.kernel)?;
    writeln!(
        md,
        "| Kubernetes (apiserver, controller-manager, scheduler) | {} |",
        e.kubernetes
    )?;
    writeln!(md, "| etcd / kwok | {} / {} |", e.etcd, e.kwok)?;
    writeln!(md, "| Rust / kube-rs | {} / {} |", e.rustc, e.kube_rs)?;
    writeln!(
        md,
        "| Go / controller-runtime | {} / {} |",
        e.go, e.controller_runtime
    )?;
    writeln!(
        md,
        "| workload | each Tenant: 2 owners, 1 extra `view` binding, {} namespace(s) with 2 RoleBindings, ResourceQuota, LimitRange, NetworkPolicy; plus ClusterRole and ClusterRoleBinding ({} objects per Tenant); {} unrelated ConfigMaps and Secrets (1 KiB each) in the cluster throughout |",
        a.namespaces_per_tenant,
        a.namespaces_per_tenant * 6 + 2,
        a.unrelated
    )?;
    writeln!(
        md,
        "| settings | {} concurrent reconciles (floor: {} writers); harness creates Tenants {} at a time; Lease {:?}/{:?}/{:?} |\n",
        a.concurrency,
        a.concurrency,
        super::workload::CREATE_CONCURRENCY,
        a.lease[0],
        a.lease[1],
        a.lease[2]
    )?;

    writeln!(md, "## 1–2. Convergence and API load\n")?;
    writeln!(
        md,
        "Convergence: from the first Tenant create until the harness's watch has seen every Tenant `Ready=True` with `status.observedGeneration == metadata.generation`. \
        Requests: `apiserver_request_total` from the kube-apiserver's `/metrics`, difference over the window, less the background rate measured before the run (kube-controller-manager, scheduler, kwok), \
        less the harness's own Tenant creates; writes to ServiceAccounts/ConfigMaps that kube-controller-manager makes in new namespaces and quota status are not counted.\n"
    )?;
    writeln!(
        md,
        "| Tenants | subject | client rate limit | converged (s) | p50 / p99 Ready (s) | requests per Tenant by verb | writes | lease writes |"
    )?;
    writeln!(md, "|---|---|---|---|---|---|---|---|")?;
    for m in &r.runs {
        let verbs: Vec<String> = m
            .requests_per_tenant
            .iter()
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect();
        writeln!(
            md,
            "| {} | {} | {} | {:.2} | {:.2} / {:.2} | {} | {:.0} | {:.0} |",
            m.tenants,
            m.subject,
            m.client_limits,
            m.convergence_secs,
            m.ready_p50_secs,
            m.ready_p99_secs,
            verbs.join(", "),
            m.load.writes,
            m.load.lease_writes
        )?;
    }
    writeln!(
        md,
        "\n<details><summary>Requests by verb and resource</summary>\n"
    )?;
    for m in &r.runs {
        let rows: Vec<String> = m
            .load
            .by_resource
            .iter()
            .map(|(k, v)| format!("{k}: {v:.0}"))
            .collect();
        writeln!(md, "- {} × {}: {}", m.subject, m.tenants, rows.join(", "))?;
    }
    writeln!(md, "\n</details>\n")?;

    writeln!(md, "## 2. Idle writes after convergence\n")?;
    writeln!(
        md,
        "| Tenants | subject | window (s) | writes (excluding leases) | lease writes | requests by verb |\n|---|---|---|---|---|---|"
    )?;
    for m in r.runs.iter().filter(|m| m.idle.is_some()) {
        if let Some(i) = &m.idle {
            let verbs: Vec<String> = i
                .by_resource
                .iter()
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect();
            writeln!(
                md,
                "| {} | {} | {:.0} | {:.0} | {:.0} | {} |",
                m.tenants,
                m.subject,
                m.idle_window_secs,
                i.writes,
                i.lease_writes,
                verbs.join(", ")
            )?;
        }
    }
    writeln!(
        md,
        "\n### The other operators\n\nEach runs as its binary with its objects converged, is restarted (the new process reconciles everything from empty caches, as a new leader does) and stays idle with its resyncs on; writes are the API server's own counts in the window (leases excluded, background subtracted). Events are shown apart: on kwok nodes the PostgresClusters' pods cannot run, and the scheduler and the volume controller keep writing Events about them. SQL: statements that changed anything on the Databases' PostgreSQL server (`log_statement = 'mod'`).\n"
    )?;
    writeln!(
        md,
        "| operator | objects | window (s) | resync | reconciles | writes (excluding Events) | Event writes | SQL statements that changed something | writes by verb |\n|---|---|---|---|---|---|---|---|---|"
    )?;
    for w in &r.idle_writes {
        match w {
            Ok(w) => {
                let by: Vec<String> = w
                    .writes
                    .iter()
                    .map(|(k, v)| format!("{k} {v:.0}"))
                    .collect();
                writeln!(
                    md,
                    "| {} | {} | {:.0} | {} | {:.0} | {:.0}{} | {:.0} | {} | {} |",
                    w.operator,
                    w.objects,
                    w.window_secs,
                    w.resync_secs
                        .map_or("none (waits for changes)".to_string(), |s| format!(
                            "{s:.0} s"
                        )),
                    w.reconciles,
                    w.total_writes(),
                    overlapped(w),
                    w.event_writes(),
                    w.sql_changes.map_or("—".to_string(), |n| {
                        if w.sql_sample.is_empty() {
                            n.to_string()
                        } else {
                            format!("{n} (e.g. `{}`)", w.sql_sample.join("`, `"))
                        }
                    }),
                    by.join(", ")
                )?;
            }
            Err(e) => writeln!(md, "| {e} | | | | | | | | |")?,
        }
    }
    writeln!(md, "\n## 3. Memory\n")?;
    writeln!(
        md,
        "Resident memory (`VmRSS`) of the leader at the end of the idle window and its peak (`VmHWM`), from `/proc/<pid>/status`; \
        and the CPU time (user and system) it used while converging (first Tenant created → all Ready), from `/proc/<pid>/stat`.\n"
    )?;
    writeln!(
        md,
        "| Tenants | subject | RSS | peak RSS | CPU while converging |\n|---|---|---|---|---|"
    )?;
    for m in &r.runs {
        if let (Some(rss), Some(hwm)) = (m.rss_bytes, m.rss_peak_bytes) {
            writeln!(
                md,
                "| {} | {} | {} | {} | {} |",
                m.tenants,
                m.subject,
                mib(rss),
                mib(hwm),
                m.convergence_cpu_secs
                    .map_or("–".to_string(), |c| format!("{c:.1} s"))
            )?;
        }
    }
    for m in &r.runs {
        if let Some(kinds) = &m.cache {
            cache_table(&mut md, m.tenants, kinds)?;
        }
    }
    writeln!(md, "\n## 4. Failover\n")?;
    writeln!(
        md,
        "Two replicas. The leader (the replica whose `/metrics` says `leader_election_master_status 1`) gets SIGKILL (or SIGTERM) at a random moment 1.5–3.5 × RetryPeriod after the standby is ready; right after the signal the harness changes a Tenant's spec; \
        measured: from the signal until the harness's watch sees that Tenant's new generation observed and Ready, i.e. the first reconcile by the new leader that wrote (it includes the new leader's resync of every Tenant, which it queues on acquiring the Lease). \
        Also shown: signal → the Lease's `acquireTime`. The signalled replica is restarted as the new standby before the next repetition.\n"
    )?;
    writeln!(
        md,
        "| Tenants | subject | lease (s) | SIGKILL: median / max (s) | lease acquired median / max | SIGTERM: median / max (s) | lease acquired median / max |\n|---|---|---|---|---|---|---|"
    )?;
    for m in &r.runs {
        if let Some(f) = &m.failover {
            let (km, kx) = median_max(&f.kill_secs);
            let (klm, klx) = median_max(&f.kill_lease_secs);
            let (tm, tx) = median_max(&f.term_secs);
            let (tlm, tlx) = median_max(&f.term_lease_secs);
            writeln!(
                md,
                "| {} | {} | {:.0}/{:.0}/{:.0} | {km:.2} / {kx:.2} (n={}) | {klm:.2} / {klx:.2} | {tm:.2} / {tx:.2} (n={}) | {tlm:.2} / {tlx:.2} |",
                m.tenants,
                m.subject,
                f.lease[0],
                f.lease[1],
                f.lease[2],
                f.kill_secs.len(),
                f.term_secs.len()
            )?;
        }
    }
    writeln!(md, "\n## 5. Orchestration overhead\n")?;
    match &r.orchestration {
        Ok(o) => {
            writeln!(
                md,
                "One UpgradePlan over a chain of {} Deployments (2 replicas each, maxSurge 2, each depending on the previous; kwok runs the pods). \
                The harness's own Deployment watch records when a Deployment turned healthy with the new image (the orchestrator's rule: generation observed, all replicas updated and available, no old ones) \
                and when the next Deployment's template got the new image: the overhead is the difference. Plan created → Succeeded: {:.2} s.\n",
                o.components, o.total_secs
            )?;
            let (m, x) = median_max(&o.overhead_secs);
            let (sm, sx) = median_max(&o.status_overhead_secs);
            let (lm, lx) = median_max(&o.finished_lag_secs);
            writeln!(
                md,
                "| measure | median (s) | max (s) | values |\n|---|---|---|---|"
            )?;
            let list = |v: &[f64]| {
                v.iter()
                    .map(|x| format!("{x:.3}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            writeln!(
                md,
                "| healthy → next component changed (watch) | {m:.3} | {x:.3} | {} |",
                list(&o.overhead_secs)
            )?;
            writeln!(
                md,
                "| plan status: finishedAt → next startedAt | {sm:.3} | {sx:.3} | {} |",
                list(&o.status_overhead_secs)
            )?;
            writeln!(
                md,
                "| healthy (watch) → plan finishedAt | {lm:.3} | {lx:.3} | {} |\n",
                list(&o.finished_lag_secs)
            )?;
        }
        Err(e) => writeln!(md, "{e}\n")?,
    }
    sharded_section(&mut md, r)?;
    db_sharded_section(&mut md, r)?;
    writeln!(md, "## 6. Startup and binary size\n")?;
    writeln!(
        md,
        "The operator is stopped (SIGTERM), one Tenant's spec is changed, the operator is started again (it takes the released Lease). \
        Measured from process start to `/readyz` 200 (caches synced) and to the changed Tenant showing its new generation observed.\n"
    )?;
    writeln!(
        md,
        "| Tenants | subject | start → ready (s) | start → first reconcile (s) | ready → first reconcile (s) |\n|---|---|---|---|---|"
    )?;
    for m in &r.runs {
        if let Some(s) = &m.startup {
            writeln!(
                md,
                "| {} | {} | {:.3} | {:.3} | {:.3} |",
                m.tenants,
                m.subject,
                s.to_ready_secs,
                s.to_first_reconcile_secs,
                s.after_ready_secs
            )?;
        }
    }
    writeln!(md, "\n| binary | size |\n|---|---|")?;
    for (k, v) in &r.binary_sizes {
        writeln!(md, "| {k} | {} |", mib(*v))?;
    }

    writeln!(md, "\n## Goals\n")?;
    writeln!(md, "| goal | measured | |\n|---|---|---|")?;
    for &n in &a.tenants {
        let (Some(st), Some(fl)) = (find(r, "steward", n), find(r, "floor", n)) else {
            continue;
        };
        let ratio = st.convergence_secs / fl.convergence_secs;
        // #43 asks for a tighter bound at 10 000 Tenants, where per-object costs dominate.
        let bound = if n >= 10_000 { 1.05 } else { 1.2 };
        writeln!(
            md,
            "| {n} Tenants: convergence ≤ {bound} × raw-write floor | {:.2}s vs {:.2}s = {ratio:.2}× | {} |",
            st.convergence_secs,
            fl.convergence_secs,
            verdict(ratio <= bound)
        )?;
        let requests: f64 = st
            .requests_per_tenant
            .iter()
            .filter(|(verb, _)| verb.as_str() != "WATCH")
            .map(|(_, v)| v)
            .sum();
        writeln!(
            md,
            "| {n} Tenants: ≤ 10.5 requests per Tenant while converging | {requests:.2} | {} |",
            verdict(requests <= 10.5)
        )?;
        if let Some(cr) = find(r, "controller-runtime", n) {
            writeln!(
                md,
                "| {n} Tenants: faster than controller-runtime (both without client-side limit) | {:.2}s vs {:.2}s | {} |",
                st.convergence_secs,
                cr.convergence_secs,
                verdict(st.convergence_secs < cr.convergence_secs)
            )?;
            if let (Some(a), Some(b)) = (st.rss_bytes, cr.rss_bytes) {
                writeln!(
                    md,
                    "| {n} Tenants: memory ≤ 0.33 × controller-runtime | {} vs {} = {:.2}× | {} |",
                    mib(a),
                    mib(b),
                    a as f64 / b as f64,
                    verdict(a as f64 <= 0.33 * b as f64)
                )?;
            }
        }
        if let Some(i) = &st.idle {
            writeln!(
                md,
                "| {n} Tenants: zero idle writes ({:.0} s) | {:.0} writes (+{:.0} lease renewals) | {} |",
                st.idle_window_secs,
                i.writes,
                i.lease_writes,
                verdict(i.writes == 0.0)
            )?;
        }
        if let Some(f) = &st.failover {
            let (_, kx) = median_max(&f.kill_secs);
            let (tm, tx) = median_max(&f.term_secs);
            writeln!(
                md,
                "| failover after SIGKILL ≤ LeaseDuration + RetryPeriod ({:.0}s) | max {kx:.2}s | {} |",
                f.lease[0] + f.lease[2],
                verdict(kx <= f.lease[0] + f.lease[2])
            )?;
            writeln!(
                md,
                "| failover after graceful shutdown ≤ 2 × RetryPeriod ({:.0}s) | max {tx:.2}s | {} |",
                2.0 * f.lease[2],
                verdict(tx <= 2.0 * f.lease[2])
            )?;
            writeln!(
                md,
                "| failover after graceful shutdown ≤ 0.3 s (median) | median {tm:.2}s | {} |",
                verdict(tm <= 0.3)
            )?;
        }
        if let Some(s) = &st.startup {
            writeln!(
                md,
                "| {n} Tenants: first reconcile < 1 s after cache sync | {:.3}s | {} |",
                s.after_ready_secs,
                verdict(s.after_ready_secs < 1.0)
            )?;
        }
    }
    match &r.orchestration {
        Ok(o) => {
            let (_, x) = median_max(&o.overhead_secs);
            writeln!(
                md,
                "| orchestration overhead < 1 s | max {x:.3}s over {} hand-overs | {} |",
                o.overhead_secs.len(),
                verdict(x < 1.0)
            )?;
        }
        Err(_) => writeln!(md, "| orchestration overhead < 1 s | not measured | |")?,
    }
    for w in r.idle_writes.iter().flatten() {
        let sql = w.sql_changes.unwrap_or(0);
        writeln!(
            md,
            "| {}: zero idle writes ({}; {:.0} s, restart included) | {:.0} writes{}{} | {} |",
            w.operator,
            w.objects,
            w.window_secs,
            w.total_writes(),
            overlapped(w),
            w.sql_changes.map_or(String::new(), |n| format!(
                ", {n} SQL statements that changed something"
            )),
            verdict(w.total_writes() == 0.0 && sql == 0)
        )?;
    }
    sharded_goals(&mut md, r)?;
    match &r.db_sharded {
        Ok(d) => writeln!(
            md,
            "| database-operator, {} shards over {} Databases and {} DatabaseRoles: one writer per shard | {} |  {} |",
            d.shards,
            d.databases,
            d.roles,
            d.per_shard
                .iter()
                .map(|s| format!("shard {}: {}", s.shard, s.writers.len()))
                .collect::<Vec<_>>()
                .join(", "),
            verdict(d.one_writer_per_shard())
        )?,
        Err(_) => writeln!(
            md,
            "| database-operator, 3 shards: one writer per shard | not measured | |"
        )?,
    }
    let notes: Vec<String> = r
        .runs
        .iter()
        .flat_map(|m| {
            m.notes
                .iter()
                .map(move |x| format!("- {} × {}: {x}", m.subject, m.tenants))
        })
        .collect();
    if !notes.is_empty() {
        writeln!(md, "\n## Notes\n\n{}", notes.join("\n"))?;
    }
    writeln!(md, "\nWhole run: {:.0} s.", r.total_secs)?;
    std::fs::write(out.join("benchmarks.md"), md)?;
    Ok(())
}

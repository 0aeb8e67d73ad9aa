//! Scenario 7: the tenant-operator scaled out, `--shards 3` on three replicas
//! (`steward_core::shard`), against the single leader measured before it in the same run.
//!
//! Measured: convergence of N Tenants; each replica's resident memory; the latency of a spec
//! change (change → new generation observed and Ready) without a failure, and on the healthy
//! shards while one replica is SIGKILLed and its shard has no holder; how long until the
//! dead replica's shard is held again (SIGKILL → the shard Lease's `acquireTime`) and until a
//! Tenant of that shard changed right after the kill is reconciled.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use serde::Serialize;
use steward_core::shard::shard_of;

use super::procs::{Launch, Replica};
use super::workload;
use super::{Args, Cluster};

/// Shards and replicas of the scenario.
pub const SHARDS: u32 = 3;

/// What scenario 7 measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sharded {
    pub tenants: usize,
    pub shards: u32,
    pub replicas: usize,
    pub lease: [f64; 3],
    pub convergence_secs: f64,
    /// Each replica's resident memory after convergence (bytes).
    pub rss_bytes: Vec<u64>,
    /// Spec change → observed, on any shard, no failure (seconds).
    pub steady_latency_secs: Vec<f64>,
    /// Spec change → observed, on the healthy shards, while a killed replica's shard had no
    /// holder yet (seconds).
    pub failover_latency_secs: Vec<f64>,
    /// SIGKILL → the dead replica's shard Lease `acquireTime` by another replica (seconds).
    pub takeover_secs: Vec<f64>,
    /// SIGKILL → a Tenant of that shard changed right after the kill is observed (seconds).
    pub dead_shard_reconciled_secs: Vec<f64>,
}

/// The holder and acquireTime of shard `shard`'s Lease.
pub(crate) async fn holder(
    leases: &Api<Lease>,
    id: &str,
    shard: u32,
) -> Option<(String, k8s_openapi::jiff::Timestamp)> {
    let spec = leases
        .get_opt(&format!("{id}-shard-{shard}"))
        .await
        .ok()??
        .spec?;
    let h = spec.holder_identity.filter(|h| !h.is_empty())?;
    Some((h, spec.acquire_time?.0))
}

/// Waits until every shard is held by a distinct replica (the ring settled).
pub(crate) async fn balanced(leases: &Api<Lease>, id: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut holders = std::collections::BTreeSet::new();
        for s in 0..SHARDS {
            if let Some((h, _)) = holder(leases, id, s).await {
                holders.insert(h);
            }
        }
        if holders.len() == SHARDS as usize {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("shards not spread over {SHARDS} replicas after {timeout:?}: {holders:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Bumps `tenant` and returns how long until its new generation was observed.
async fn change(
    client: &Client,
    tracker: &workload::Tracker,
    tenant: &str,
    value: usize,
) -> Result<f64> {
    let t0 = Instant::now();
    let generation = workload::bump(client, tenant, value).await?;
    let seen = tracker
        .wait_observed(tenant, generation, Duration::from_secs(180))
        .await?;
    Ok(seen.saturating_duration_since(t0).as_secs_f64())
}

/// Runs scenario 7 with `n` Tenants on `cluster`; `launch` is the single-leader steward
/// subject's.
pub(super) async fn measure(
    args: &Args,
    cluster: &Cluster,
    launch: &Launch,
    n: usize,
) -> Result<Sharded> {
    let (client, kubeconfig) = (&cluster.client, cluster.cp.kubeconfig_path());
    let id = "bench-sharded";
    let mut launch = launch.clone();
    launch
        .args
        .retain(|a| !a.starts_with("--leader-election-id="));
    launch.args.extend([
        format!("--leader-election-id={id}"),
        format!("--shards={SHARDS}"),
    ]);
    launch.label = "steward-sharded".into();
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let run = format!("sh{n}");
    let (tracker, watch) = workload::Tracker::start(client, &run);
    let mut m = Sharded {
        tenants: n,
        shards: SHARDS,
        replicas: SHARDS as usize,
        lease: args.lease.map(|d| d.as_secs_f64()),
        ..Default::default()
    };
    let mut index = 100;
    let mut replicas = Vec::new();
    for _ in 0..SHARDS {
        let mut r = Replica::spawn(&launch, kubeconfig, index)?;
        index += 1;
        r.wait_ready(Duration::from_secs(120)).await?;
        replicas.push(r);
    }
    balanced(&leases, id, Duration::from_secs(120)).await?;

    let t0 = Instant::now();
    workload::create_tenants(client, &run, n, args.namespaces_per_tenant, None).await?;
    let ready = tracker
        .wait_all_ready(n, Duration::from_secs(120 + n as u64))
        .await?;
    m.convergence_secs = ready
        .iter()
        .map(|t| t.saturating_duration_since(t0).as_secs_f64())
        .fold(0.0, f64::max);
    for r in &replicas {
        m.rss_bytes.push(r.memory()?.0);
    }

    let names: Vec<String> = (0..n).map(|i| workload::tenant_name(&run, i)).collect();
    let of_shard =
        |s: u32| -> Vec<&String> { names.iter().filter(|t| shard_of(t, SHARDS) == s).collect() };
    let mut value = 5_000_000;
    let samples = if args.smoke { 3 } else { 30 };
    for i in 0..samples {
        value += 1;
        let t = &names[i % names.len()];
        m.steady_latency_secs
            .push(change(client, &tracker, t, value).await?);
    }

    let reps = if args.smoke {
        1
    } else {
        args.failovers.clamp(1, 5)
    };
    for rep in 0..reps {
        let shard = u32::try_from(rep).unwrap_or(0) % SHARDS;
        let (Some(dead_tenant), Some(healthy)) = (
            of_shard(shard).first().map(|s| (*s).clone()),
            Some(
                names
                    .iter()
                    .filter(|t| shard_of(t, SHARDS) != shard)
                    .cloned()
                    .collect::<Vec<_>>(),
            )
            .filter(|h| !h.is_empty()),
        ) else {
            bail!("too few Tenants to have one in every shard ({n})");
        };
        let lease = format!("{id}-shard-{shard}");
        let mut victim = None;
        for (i, r) in replicas.iter().enumerate() {
            if r.holds(&lease).await {
                victim = Some(i);
            }
        }
        let victim = victim.with_context(|| format!("no replica holds {lease}"))?;
        let before = holder(&leases, id, shard).await.map(|h| h.0);
        // Not right after the last renewal: at a random point of the retry period.
        tokio::time::sleep(args.lease[2].mul_f64(1.5 + 2.0 * rand::random::<f64>())).await;
        let wall0 = k8s_openapi::jiff::Timestamp::now();
        let killed = Instant::now();
        replicas[victim].signal("KILL")?;
        value += 1;
        let dead_generation = workload::bump(client, &dead_tenant, value).await?;
        // Healthy shards' latency until the dead shard is held again.
        let mut k = 0;
        let taken = loop {
            if let Some((h, at)) = holder(&leases, id, shard).await
                && Some(&h) != before.as_ref()
            {
                break at;
            }
            if killed.elapsed() > Duration::from_secs(180) {
                bail!("shard {shard} not taken over within 180 s");
            }
            value += 1;
            let t = &healthy[k % healthy.len()];
            k += 1;
            m.failover_latency_secs
                .push(change(client, &tracker, t, value).await?);
        };
        m.takeover_secs
            .push(taken.duration_since(wall0).as_secs_f64());
        let seen = tracker
            .wait_observed(&dead_tenant, dead_generation, Duration::from_secs(180))
            .await?;
        m.dead_shard_reconciled_secs
            .push(seen.saturating_duration_since(killed).as_secs_f64());
        eprintln!(
            "bench: sharded failover #{rep}: shard {shard} held again after {:.2}s, its Tenant reconciled after {:.2}s, {k} changes on healthy shards meanwhile",
            m.takeover_secs.last().copied().unwrap_or(f64::NAN),
            m.dead_shard_reconciled_secs
                .last()
                .copied()
                .unwrap_or(f64::NAN),
        );
        replicas[victim].wait_exit(Duration::from_secs(60)).await?;
        let mut fresh = Replica::spawn(&launch, kubeconfig, index)?;
        index += 1;
        fresh.wait_ready(Duration::from_secs(120)).await?;
        replicas[victim] = fresh;
        balanced(&leases, id, Duration::from_secs(120)).await?;
    }

    cluster.clean_up(&run, true, n).await?;
    watch.abort();
    for r in replicas {
        r.stop().await?;
    }
    Ok(m)
}

//! Helpers of the real-node test binaries (`real_node.rs`, `postgres_cluster.rs`).

#![allow(dead_code)] // each binary uses its part

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, LogParams, PostParams};
use steward_testenv::{ControlPlane, Options, RealNode, eventually};

pub const WAIT: Duration = Duration::from_secs(90);

/// A control plane with a real node (and no kwok nodes).
pub async fn start() -> ControlPlane {
    let started = Instant::now();
    let cp = ControlPlane::start(Options {
        nodes: 0,
        real_node: true,
        ..Options::default()
    })
    .await
    .expect("control plane with a real node");
    eprintln!(
        "control plane with a Ready real node in {:.1?} (node {:.1?})",
        started.elapsed(),
        node(&cp).started_in()
    );
    cp
}

/// A control plane with `count` real nodes (each in a network namespace and a zone of its
/// own) and no kwok nodes.
pub async fn start_nodes(count: usize) -> ControlPlane {
    let started = Instant::now();
    let cp = ControlPlane::start(Options::real_nodes(count))
        .await
        .expect("control plane with several real nodes");
    let nodes: Vec<String> = cp
        .real_nodes()
        .iter()
        .map(|n| format!("{} {:.1?}", n.name(), n.started_in()))
        .collect();
    eprintln!(
        "control plane with {count} Ready real nodes in {:.1?} ({})",
        started.elapsed(),
        nodes.join(", ")
    );
    cp
}

/// Creates Service `name` in `ns` selecting `app: <app>` on `port` (to `target_port`); returns
/// its ClusterIP.
pub async fn service(
    cp: &ControlPlane,
    ns: &str,
    name: &str,
    port: u16,
    target_port: u16,
) -> String {
    let services: Api<Service> = Api::namespaced(cp.client().expect("client"), ns);
    let svc: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": port, "targetPort": target_port}]}
    }))
    .expect("Service manifest");
    services
        .create(&PostParams::default(), &svc)
        .await
        .expect("create Service")
        .spec
        .and_then(|s| s.cluster_ip)
        .unwrap_or_default()
}

pub fn node(cp: &ControlPlane) -> &RealNode {
    cp.real_node().expect("started with real_node: true")
}

/// The log of `name`'s (first) container, or why it could not be read.
pub async fn logs(pods: &Api<Pod>, name: &str) -> String {
    pods.logs(name, &LogParams::default())
        .await
        .unwrap_or_else(|e| format!("<logs unavailable: {e}>"))
}

/// A connection as `postgres` to `host:5432`, retried until it succeeds (the Service's
/// endpoint and kube-proxy's rules follow the pod's readiness).
pub async fn connect(
    host: &str,
    password: &str,
) -> Result<tokio_postgres::Client, steward_testenv::Error> {
    let conn = format!(
        "host={host} port=5432 user=postgres password={password} dbname=postgres connect_timeout=5"
    );
    eventually(&format!("a connection to {host}:5432"), WAIT, || {
        let conn = conn.clone();
        async move {
            let (client, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls)
                .await
                .map_err(|e| format!("{e:?}"))?;
            tokio::spawn(connection);
            Ok(client)
        }
    })
    .await
}

pub fn rand_u32() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
        .unwrap_or(7)
}

/// `GET /` from the test process (the host) to `addr:port`, within 2 s.
pub async fn get(addr: &str, port: u16) -> Result<String, String> {
    let fetch = async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect((addr, port))
            .await
            .map_err(|e| e.to_string())?;
        stream
            .write_all(b"GET / HTTP/1.0\r\n\r\n")
            .await
            .map_err(|e| e.to_string())?;
        let mut text = String::new();
        stream
            .read_to_string(&mut text)
            .await
            .map_err(|e| e.to_string())?;
        Ok(text)
    };
    tokio::time::timeout(Duration::from_secs(2), fetch)
        .await
        .map_err(|_| format!("{addr}:{port}: no answer within 2 s"))?
}

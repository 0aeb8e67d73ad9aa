//! Starts a control plane, prints how to reach it, and stops it again after `SECONDS`
//! (default: on Ctrl-C). `--real-node` adds a real node (as root).
//! `cargo run -p steward-testenv --example start [--real-node] [SECONDS]`
#[tokio::main]
async fn main() -> Result<(), steward_testenv::Error> {
    let real_node = std::env::args().any(|a| a == "--real-node");
    let cp = steward_testenv::ControlPlane::start(steward_testenv::Options {
        nodes: if real_node { 0 } else { 2 },
        real_node,
        ..Default::default()
    })
    .await?;
    println!(
        "control plane ready in {:.1?}: {}",
        cp.started_in(),
        cp.apiserver_url()
    );
    if let Some(node) = cp.real_node() {
        println!(
            "real node {} Ready (node start {:.1?})",
            node.name(),
            node.started_in()
        );
    }
    println!("export KUBECONFIG={}", cp.kubeconfig_path().display());
    match std::env::args().skip(1).find_map(|s| s.parse::<u64>().ok()) {
        Some(secs) => tokio::time::sleep(std::time::Duration::from_secs(secs)).await,
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    Ok(())
}

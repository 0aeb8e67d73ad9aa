//! Starts a control plane, prints how to reach it, and stops it again after `SECONDS`
//! (default: on Ctrl-C). `cargo run -p steward-testenv --example start [SECONDS]`
#[tokio::main]
async fn main() -> Result<(), steward_testenv::Error> {
    let cp = steward_testenv::ControlPlane::start(steward_testenv::Options::default()).await?;
    println!(
        "control plane ready in {:.1?}: {}",
        cp.started_in(),
        cp.apiserver_url()
    );
    println!("export KUBECONFIG={}", cp.kubeconfig_path().display());
    match std::env::args().nth(1).and_then(|s| s.parse::<u64>().ok()) {
        Some(secs) => tokio::time::sleep(std::time::Duration::from_secs(secs)).await,
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    Ok(())
}

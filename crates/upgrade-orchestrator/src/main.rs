//! The `upgrade-orchestrator` binary; see [`upgrade_orchestrator::UpgradeOrchestrator`].

fn main() -> std::process::ExitCode {
    steward_core::operator::main::<upgrade_orchestrator::UpgradeOrchestrator>()
}

//! `tenant-operator`: runs the Tenant controller (or, with `--print-policies`, prints the
//! admission policies); see [`tenant_operator::TenantOperator`].

fn main() -> std::process::ExitCode {
    steward_core::operator::main::<tenant_operator::TenantOperator>()
}

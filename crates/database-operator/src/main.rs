//! The database-operator binary; see [`database_operator::DatabaseOperator`].

fn main() -> std::process::ExitCode {
    steward_core::operator::main::<database_operator::DatabaseOperator>()
}

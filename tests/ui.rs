//! Compile errors of `#[idempotent]`: one case per file under `ui/`, each with the exact
//! message it must print. Regenerate with `TRYBUILD=overwrite` and read the diff.

#[test]
fn ui() {
    trybuild::TestCases::new().compile_fail("ui/*.rs");
}

//! The README's table of `#[idempotent]` arguments is the attribute's rustdoc, word for word:
//! both are `idem-macros/src/reference.md`, whose examples the macro's unit tests parse.

#[test]
fn the_readme_s_argument_table_is_the_attribute_s() {
    let readme = include_str!("../README.md");
    let reference = include_str!("../idem-macros/src/reference.md");
    let start = "<!-- reference:start -->\n";
    let end = "<!-- reference:end -->";
    let from = readme
        .find(start)
        .expect("README.md marks the reference's start")
        + start.len();
    let to = readme[from..]
        .find(end)
        .expect("README.md marks the reference's end")
        + from;
    assert_eq!(
        &readme[from..to],
        reference,
        "README.md's argument table differs from idem-macros/src/reference.md: copy the file between the markers"
    );
}

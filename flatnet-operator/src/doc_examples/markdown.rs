//! The ```yaml blocks of a Markdown page, for the tests that check the
//! examples in docs/ (the operator's, and the agent's `doc_examples`,
//! which includes this file by path).

/// The ```yaml blocks of `page`, in order, each with its lines as written.
pub fn yaml_blocks(page: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in page.lines() {
        match (&mut current, line.trim()) {
            (None, "```yaml") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

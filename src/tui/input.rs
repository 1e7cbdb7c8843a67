//! The message editor: multi-line text with a cursor, and recall of earlier messages.

/// Cursor positions are in characters (not bytes) within a line.
#[derive(Debug, Default, Clone)]
pub struct InputEditor {
    lines: Vec<String>,
    row: usize,
    column: usize,
    /// Sent messages, oldest first.
    history: Vec<String>,
    /// Position while browsing the history (`history.len()` = the draft being written).
    history_index: usize,
    /// The unsent text, kept while browsing the history.
    draft: Option<String>,
}

impl InputEditor {
    pub fn new() -> Self {
        InputEditor { lines: vec![String::new()], ..Default::default() }
    }

    pub fn text(&self) -> String {
        self.lines.join("\n")
    }

    pub fn lines(&self) -> &[String] {
        &self.lines
    }

    pub fn is_empty(&self) -> bool {
        self.lines.len() == 1 && self.lines[0].is_empty()
    }

    /// (row, column in characters).
    pub fn cursor(&self) -> (usize, usize) {
        (self.row, self.column)
    }

    pub fn insert_char(&mut self, c: char) {
        let at = self.byte_offset();
        self.lines[self.row].insert(at, c);
        self.column += 1;
    }

    pub fn insert_newline(&mut self) {
        let at = self.byte_offset();
        let rest = self.lines[self.row].split_off(at);
        self.row += 1;
        self.lines.insert(self.row, rest);
        self.column = 0;
    }

    /// Inserts pasted text, its line breaks included: terminals send a pasted line break as a
    /// carriage return (`\r`), files may hold `\r\n` or `\n`; each is one new line.
    pub fn insert_str(&mut self, text: &str) {
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\r' => {
                    chars.next_if_eq(&'\n');
                    self.insert_newline();
                }
                '\n' => self.insert_newline(),
                c => self.insert_char(c),
            }
        }
    }

    pub fn backspace(&mut self) {
        if self.column > 0 {
            self.column -= 1;
            let at = self.byte_offset();
            self.lines[self.row].remove(at);
        } else if self.row > 0 {
            let line = self.lines.remove(self.row);
            self.row -= 1;
            self.column = self.lines[self.row].chars().count();
            self.lines[self.row].push_str(&line);
        }
    }

    pub fn delete(&mut self) {
        let len = self.lines[self.row].chars().count();
        if self.column < len {
            let at = self.byte_offset();
            self.lines[self.row].remove(at);
        } else if self.row + 1 < self.lines.len() {
            let next = self.lines.remove(self.row + 1);
            self.lines[self.row].push_str(&next);
        }
    }

    pub fn move_left(&mut self) {
        if self.column > 0 {
            self.column -= 1;
        } else if self.row > 0 {
            self.row -= 1;
            self.column = self.line_len();
        }
    }

    pub fn move_right(&mut self) {
        if self.column < self.line_len() {
            self.column += 1;
        } else if self.row + 1 < self.lines.len() {
            self.row += 1;
            self.column = 0;
        }
    }

    pub fn home(&mut self) {
        self.column = 0;
    }

    pub fn end(&mut self) {
        self.column = self.line_len();
    }

    /// Up: the line above, or from the first line the previous message of the history.
    pub fn up(&mut self) {
        if self.row > 0 {
            self.row -= 1;
            self.column = self.column.min(self.line_len());
        } else if self.history_index > 0 {
            if self.history_index == self.history.len() {
                self.draft = Some(self.text());
            }
            self.history_index -= 1;
            let text = self.history[self.history_index].clone();
            self.set_text(&text);
        }
    }

    /// Down: the line below, or from the last line the next message of the history (and at the
    /// end of the history, the draft that was being written).
    pub fn down(&mut self) {
        if self.row + 1 < self.lines.len() {
            self.row += 1;
            self.column = self.column.min(self.line_len());
        } else if self.history_index < self.history.len() {
            self.history_index += 1;
            let text = if self.history_index == self.history.len() { self.draft.take().unwrap_or_default() } else { self.history[self.history_index].clone() };
            self.set_text(&text);
        }
    }

    /// Empties the editor and returns what it held; non-empty text joins the history.
    pub fn take(&mut self) -> String {
        let text = self.text();
        if !text.trim().is_empty() && self.history.last() != Some(&text) {
            self.history.push(text.clone());
        }
        self.history_index = self.history.len();
        self.draft = None;
        self.set_text("");
        text
    }

    pub fn clear(&mut self) {
        self.set_text("");
    }

    fn set_text(&mut self, text: &str) {
        self.lines = text.split('\n').map(String::from).collect();
        self.row = self.lines.len() - 1;
        self.column = self.line_len();
    }

    fn line_len(&self) -> usize {
        self.lines[self.row].chars().count()
    }

    fn byte_offset(&self) -> usize {
        let line = &self.lines[self.row];
        line.char_indices().nth(self.column).map_or(line.len(), |(i, _)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn typed(text: &str) -> InputEditor {
        let mut editor = InputEditor::new();
        editor.insert_str(text);
        editor
    }

    #[test]
    fn multi_line_editing() {
        let mut editor = typed("héllo");
        editor.insert_newline();
        editor.insert_str("world");
        assert_eq!(editor.text(), "héllo\nworld");
        editor.home();
        editor.backspace();
        assert_eq!(editor.text(), "hélloworld");
        assert_eq!(editor.cursor(), (0, 5));
        editor.move_left();
        editor.delete();
        assert_eq!(editor.text(), "héllworld");
    }

    #[test]
    fn history_recall_keeps_the_draft() {
        let mut editor = typed("first");
        assert_eq!(editor.take(), "first");
        editor.insert_str("second\nline");
        editor.take();
        editor.insert_str("draft");
        editor.up();
        assert_eq!(editor.text(), "second\nline");
        // The cursor is on the last line of the recalled text: Up moves within it first.
        editor.up();
        assert_eq!(editor.cursor().0, 0);
        editor.up();
        assert_eq!(editor.text(), "first");
        editor.up();
        assert_eq!(editor.text(), "first");
        editor.down();
        assert_eq!(editor.text(), "second\nline");
        editor.down();
        assert_eq!(editor.text(), "draft");
    }

    #[test]
    fn pasted_line_breaks_are_kept_whatever_their_form() {
        for pasted in ["one\rtwo\rthree", "one\r\ntwo\r\nthree", "one\ntwo\nthree", "one\r\ntwo\nthree"] {
            assert_eq!(typed(pasted).text(), "one\ntwo\nthree", "{pasted:?}");
        }
        assert_eq!(typed("a\r\r\nb").text(), "a\n\nb");
    }

    #[test]
    fn empty_messages_do_not_enter_the_history() {
        let mut editor = InputEditor::new();
        editor.take();
        editor.up();
        assert!(editor.is_empty());
    }
}

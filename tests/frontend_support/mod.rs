//! Helpers shared by the server and TUI tests: scripted models, a `kestrel serve` child process,
//! a minimal HTTP client, and running helper programs under a deadline.
#![allow(dead_code)]

pub mod scripted_model;

use scripted_model::{chain, script_chains, write_scripted_model, Script};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The chat model's answer to anything: this sentence, repeated until `max_tokens`.
pub const CHAT_REPLY: &str = "The kestrel hovers and waits; then it dives.\n";
/// Tokens in one `CHAT_REPLY`.
pub const CHAT_REPLY_TOKENS: usize = 13;
/// The tool model's answer to anything (then `<|im_end|>`).
pub const TOOL_CALL_TEXT: &str = "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"days\":3}}</tool_call>";
/// The newline token: every ChatML generation prompt ends with it.
const NEWLINE_TOKEN: u32 = 198;
/// `<|im_start|>assistant`: the tokens before the newline of a ChatML generation prompt.
const ASSISTANT: [u32; 2] = [151_644, 77_091];
/// The tokens before the last newline(s) of a thinking template's generation prompt: `\n<think>`
/// with thinking on (Qwen3.5's), `\n\n</think>` with thinking off (`<think>\n\n</think>\n\n`).
const THINKING_ON: [u32; 2] = [198, 151_667];
const THINKING_OFF: [u32; 2] = [271, 151_668];
/// `\n\n`: the generation prompt of a thinking template with thinking turned off ends with it.
const BLANK_LINE_TOKEN: u32 = 271;
/// `<|im_end|>`, the end of an assistant turn.
const END_OF_TURN_TOKEN: u32 = 151_645;

/// The thinking model's reasoning, then its answer (a sentence, then a JSON tool call).
pub const THINKING_REASONING: &str = "The user wants the weather.\nI will call get_weather.";
pub const THINKING_ANSWER: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 3}}\n</tool_call>";
/// Its answer when the template's thinking is turned off.
pub const THINKING_OFF_ANSWER: &str = "Sure, here it is.";
/// The Qwen3.5-template model's reasoning and its XML tool calls.
pub const XML_REASONING: &str = "I need the weather for San Francisco.";
pub const XML_TOOL_CALLS: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=filters>\n{\"rain\": {\"min\": 0.5}, \"hours\": [6, 18], \"alerts\": true, \"station\": None}\n</parameter>\n<parameter=note>\nfirst line\nsecond line\n</parameter>\n</function>\n</tool_call>";
pub const XML_THINKING_OFF_ANSWER: &str = "No tool is needed for that.";

pub fn qwen35_template() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen35/chat_template.jinja")
}
/// The NaN chat model embeds this word's tokens as NaN: a message holding it meets NaN logits.
pub const POISON_WORD: &str = "nightshade";

pub fn qwen3_tokenizer_dir() -> PathBuf {
    std::env::var_os("KESTREL_QWEN3_TOKENIZER_DIR")
        .map(PathBuf::from)
        .expect("set KESTREL_QWEN3_TOKENIZER_DIR to a folder filled by scripts/fetch_qwen3_tokenizer.sh (bash .ci/run does both)")
}

/// Where the scripted models are written: a temporary directory, or `KESTREL_TEST_MODELS_DIR`
/// to keep them (to try a failing case by hand with `kestrel serve --model ...`).
fn models_root() -> &'static Path {
    static ROOT: OnceLock<(Option<tempfile::TempDir>, PathBuf)> = OnceLock::new();
    let (_, path) = ROOT.get_or_init(|| match std::env::var_os("KESTREL_TEST_MODELS_DIR") {
        Some(dir) => (None, PathBuf::from(dir)),
        None => {
            let temp = tempfile::tempdir().expect("temporary directory");
            let path = temp.path().to_path_buf();
            (Some(temp), path)
        }
    });
    path
}

/// A model whose reply to any chat is `CHAT_REPLY` over and over.
pub fn chat_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = models_root().join("kestrel-chat-test");
        let tokenizer = kestrel::tokenizer::Tokenizer::from_dir(&qwen3_tokenizer_dir()).expect("Qwen3 tokenizer loads");
        write_scripted_model(&dir, &qwen3_tokenizer_dir(), &chain(&tokenizer, ASSISTANT, NEWLINE_TOKEN, CHAT_REPLY), 11, &[]);
        dir
    })
}

/// The chat model, except that the tokens of `POISON_WORD` embed as NaN.
pub fn nan_chat_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = models_root().join("kestrel-nan-chat-test");
        let tokenizer = kestrel::tokenizer::Tokenizer::from_dir(&qwen3_tokenizer_dir()).expect("Qwen3 tokenizer loads");
        let transitions = chain(&tokenizer, ASSISTANT, NEWLINE_TOKEN, CHAT_REPLY);
        let mut poisoned = tokenizer.encode(POISON_WORD, false).expect("encodes");
        poisoned.extend(tokenizer.encode(&format!(" {POISON_WORD}"), false).expect("encodes"));
        // A message without the word must not touch them: the template's own tokens and the reply are clean.
        let clean = tokenizer.apply_chat_template(&[kestrel::tokenizer::ChatMessage::user("Tell me about kestrels.")], true, None).expect("template renders");
        let mut clean_ids = tokenizer.encode(&clean, false).expect("encodes");
        clean_ids.extend(transitions.iter().flat_map(|t| t.context.into_iter().chain([t.from, t.to])));
        assert!(poisoned.iter().all(|t| !clean_ids.contains(t)), "{POISON_WORD:?} shares tokens with a clean conversation");
        write_scripted_model(&dir, &qwen3_tokenizer_dir(), &transitions, 11, &poisoned);
        dir
    })
}

/// A model whose reply to any chat is `TOOL_CALL_TEXT`, then the end of its turn.
pub fn tool_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = models_root().join("kestrel-tool-test");
        let tokenizer = kestrel::tokenizer::Tokenizer::from_dir(&qwen3_tokenizer_dir()).expect("Qwen3 tokenizer loads");
        let script = Script { context: ASSISTANT, start: NEWLINE_TOKEN, text: TOOL_CALL_TEXT, end: Some(END_OF_TURN_TOKEN) };
        write_scripted_model(&dir, &qwen3_tokenizer_dir(), &script_chains(&tokenizer, &[script]), 12, &[]);
        dir
    })
}

/// A thinking model with the real Qwen3 template: with thinking on it reasons in a `<think>`
/// block it opens itself, then answers with a sentence and a JSON tool call; with thinking off
/// (the template then writes an empty block) it answers with a sentence.
pub fn thinking_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = models_root().join("kestrel-thinking-test");
        let tokenizer = kestrel::tokenizer::Tokenizer::from_dir(&qwen3_tokenizer_dir()).expect("Qwen3 tokenizer loads");
        let on = format!("<think>\n{THINKING_REASONING}\n</think>\n\n{THINKING_ANSWER}");
        let scripts = [
            Script { context: ASSISTANT, start: NEWLINE_TOKEN, text: &on, end: Some(END_OF_TURN_TOKEN) },
            Script { context: THINKING_OFF, start: BLANK_LINE_TOKEN, text: THINKING_OFF_ANSWER, end: Some(END_OF_TURN_TOKEN) },
        ];
        write_scripted_model(&dir, &qwen3_tokenizer_dir(), &script_chains(&tokenizer, &scripts), 13, &[]);
        dir
    })
}

/// A model with the real Qwen3.5 template (its generation prompt opens the `<think>` block): it
/// reasons, closes the block and calls two tools in the XML form, with several parameters, a
/// nested JSON value, a multi-line string and Python's `None`.
pub fn xml_tool_model() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = models_root().join("kestrel-xml-tool-test");
        let tokenizer = kestrel::tokenizer::Tokenizer::from_dir(&qwen3_tokenizer_dir()).expect("Qwen3 tokenizer loads");
        let on = format!("{XML_REASONING}\n</think>\n\n{XML_TOOL_CALLS}");
        let scripts = [
            Script { context: THINKING_ON, start: NEWLINE_TOKEN, text: &on, end: Some(END_OF_TURN_TOKEN) },
            Script { context: THINKING_OFF, start: BLANK_LINE_TOKEN, text: XML_THINKING_OFF_ANSWER, end: Some(END_OF_TURN_TOKEN) },
        ];
        write_scripted_model(&dir, &qwen3_tokenizer_dir(), &script_chains(&tokenizer, &scripts), 14, &[]);
        std::fs::copy(qwen35_template(), dir.join("chat_template.jinja")).expect("the Qwen3.5 template is copied");
        dir
    })
}

/// Polls `ready` every 50 ms until it returns `Some`, for at most `limit`.
pub fn wait_for<T>(limit: Duration, what: &str, mut ready: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = ready() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `kestrel serve` child on a free loopback port, killed when dropped.
pub struct ServerProcess {
    child: Child,
    pub address: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl ServerProcess {
    pub fn start(model: &Path, extra_args: &[&str]) -> ServerProcess {
        let mut args = vec!["--host".to_string(), "127.0.0.1".into(), "--model".into(), model.display().to_string()];
        args.extend(extra_args.iter().map(|a| a.to_string()));
        Self::start_with(&args)
    }

    /// `kestrel serve` on a free port on the CPU with exactly these other arguments.
    pub fn start_with(serve_args: &[String]) -> ServerProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kestrel"))
            .args(["serve", "--port", "0", "--device", "cpu"])
            .args(serve_args)
            .env("RAYON_NUM_THREADS", "2")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kestrel serve starts");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (address_tx, address_rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        // Keeps reading so the child never blocks on a full pipe; the log helps failing tests.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let address = rest.split_whitespace().next().unwrap_or_default().to_string();
                    let _ = address_tx.send(address);
                }
                let mut log = sink.lock().unwrap_or_else(|e| e.into_inner());
                log.push_str(&line);
                log.push('\n');
            }
        });
        let address = match address_rx.recv_timeout(Duration::from_secs(120)) {
            Ok(address) => address.parse().expect("a socket address"),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("kestrel serve did not report its address; its stderr:\n{}", log.lock().unwrap_or_else(|e| e.into_inner()));
            }
        };
        ServerProcess { child, address, log }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.address)
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// True while the process has not exited.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn get(&self, path: &str) -> HttpResponse {
        http_request(self.address, "GET", path, &[], b"")
    }

    /// Reads one metric value (a line `name value` of the Prometheus text).
    pub fn metric(&self, name: &str) -> f64 {
        let metrics = self.get("/metrics");
        assert_eq!(metrics.status, 200, "GET /metrics failed: {}", metrics.body);
        metric_value(&metrics.body, name).unwrap_or_else(|| panic!("metric {name} missing from:\n{}", metrics.body))
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|value| value.trim().parse().ok()))
}

pub struct HttpResponse {
    pub status: u16,
    pub body: String,
}

/// One HTTP/1.1 request with `Connection: close`, under a 60 s timeout.
pub fn http_request(address: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> HttpResponse {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(10)).expect("connects to the server");
    stream.set_read_timeout(Some(Duration::from_secs(60))).expect("read timeout");
    stream.set_write_timeout(Some(Duration::from_secs(60))).expect("write timeout");
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).expect("request head is sent");
    // The server may answer (413) and close before reading a large body; that is not a failure.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or_else(|| panic!("no HTTP status in {text:?}"));
    let body = text.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default();
    let body = if text.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(&body) } else { body };
    HttpResponse { status, body }
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size_line, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size_line.trim(), 16) else { break };
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    out
}

/// Runs a program to completion, killing it after `limit`.
pub fn run_with_deadline(command: &mut Command, limit: Duration) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot run {command:?}: {err} (bash .ci/run installs what the tests need)"));
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out_reader = std::thread::spawn(move || {
        let mut buffer = Vec::new();
        let _ = stdout.read_to_end(&mut buffer);
        buffer
    });
    let err_reader = std::thread::spawn(move || {
        let mut buffer = Vec::new();
        let _ = stderr.read_to_end(&mut buffer);
        buffer
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("child status") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let status = child.wait().expect("killed child is reaped");
            let stderr = err_reader.join().unwrap_or_default();
            panic!("{command:?} ran over {limit:?} and was killed ({status}); stderr:\n{}", String::from_utf8_lossy(&stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output { status, stdout: out_reader.join().unwrap_or_default(), stderr: err_reader.join().unwrap_or_default() }
}

/// Runs `tests/openai/<script>` with the server's base URL; panics with its output unless it
/// exits 0 and prints `PASS <check>` for each check.
pub fn run_openai_script(server: &ServerProcess, script: &str, args: &[&str], checks: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai").join(script);
    let output = run_with_deadline(Command::new("python3").arg(&path).arg("--base-url").arg(server.base_url()).args(args), Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{script} {args:?} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- server log\n{}", output.status, server.log());
    for check in checks {
        assert!(stdout.lines().any(|line| line == format!("PASS {check}")), "{script} did not pass `{check}`:\n{stdout}\n{stderr}");
    }
    stdout
}

//! Chat template rendering against outputs of Python jinja2 as transformers
//! configures it (expected strings were rendered there and pasted in).

use std::path::{Path, PathBuf};

use super::*;
use crate::tokenizer::tiny_bpe_fixture::{
    tiny_bpe_tokenizer_json, tiny_config_json, tiny_tokenizer, tiny_tokenizer_with_template,
};
use crate::tokenizer::{Tokenizer, TokenizerError};

fn render(
    template: &str,
    messages: &[ChatMessage],
    tools: Option<&serde_json::Value>,
) -> Result<String, TokenizerError> {
    tiny_tokenizer_with_template(template).apply_chat_template(messages, false, tools)
}

#[test]
fn chatml_renders_messages_and_generation_prompt() {
    let tokenizer = tiny_tokenizer();
    assert!(tokenizer.has_chat_template());
    let messages = [
        ChatMessage::system("You are terse."),
        ChatMessage::user("Hi there"),
        ChatMessage::assistant("Hello."),
        ChatMessage::user("2+2?"),
    ];
    let with_prompt = tokenizer
        .apply_chat_template(&messages, true, None)
        .expect("renders");
    assert_eq!(
        with_prompt,
        "<|im_start|>system\nYou are terse.<|im_end|>\n\
         <|im_start|>user\nHi there<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n\
         <|im_start|>user\n2+2?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let without_prompt = tokenizer
        .apply_chat_template(&messages, false, None)
        .expect("renders");
    assert_eq!(
        without_prompt,
        with_prompt.trim_end_matches("<|im_start|>assistant\n")
    );
}

#[test]
fn trim_and_lstrip_blocks_match_jinja2_as_transformers_sets_it() {
    // Block tags on their own indented lines leave no whitespace behind, and a
    // single trailing newline of the template source is dropped, as in jinja2.
    let template = "{% for message in messages %}\n    {% if message.role == 'user' %}\n[{{ message.content }}]\n    {% endif %}\n{% endfor %}\n";
    let messages = [
        ChatMessage::user("a"),
        ChatMessage::assistant("b"),
        ChatMessage::user("c"),
    ];
    assert_eq!(
        render(template, &messages, None).expect("renders"),
        "[a]\n[c]\n"
    );
}

#[test]
fn special_tokens_and_tools_variables_follow_transformers() {
    // bos_token is null in the config, so it is undefined; tools defaults to none.
    let template = "{{ bos_token is defined }}|{{ eos_token }}|{{ tools is none }}|{{ messages[0].name is defined }}";
    let output = render(template, &[ChatMessage::user("x")], None).expect("renders");
    assert_eq!(
        output, "False|<|im_end|>|True|False",
        "jinja2 prints Python booleans"
    );
}

#[test]
fn tojson_matches_python_json_dumps() {
    // Expected strings come from jinja2 with transformers' filter,
    // json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
    let template = r#"{% set data = {"name": "café <b>&amp;</b> 'q'", "nested": {"list": [1, 2.5, true, none, "世界 🙂", -0.0001], "empty_list": [], "empty_map": {}}, "ctrl": "tab\there\nline \u0001 back\\slash \"quoted\"", "big": 1e16, "small": 1.5e-7, "whole": 3.0, "zebra": 1} %}
{{ data | tojson }}
{{ data | tojson(indent=2) }}
{{ data | tojson(ensure_ascii=true, sort_keys=true) }}
{{ data.nested | tojson(separators=[",", ":"]) }}"#;
    let expected = r#"{"name": "café <b>&amp;</b> 'q'", "nested": {"list": [1, 2.5, true, null, "世界 🙂", -0.0001], "empty_list": [], "empty_map": {}}, "ctrl": "tab\there\nline \u0001 back\\slash \"quoted\"", "big": 1e+16, "small": 1.5e-07, "whole": 3.0, "zebra": 1}
{
  "name": "café <b>&amp;</b> 'q'",
  "nested": {
    "list": [
      1,
      2.5,
      true,
      null,
      "世界 🙂",
      -0.0001
    ],
    "empty_list": [],
    "empty_map": {}
  },
  "ctrl": "tab\there\nline \u0001 back\\slash \"quoted\"",
  "big": 1e+16,
  "small": 1.5e-07,
  "whole": 3.0,
  "zebra": 1
}
{"big": 1e+16, "ctrl": "tab\there\nline \u0001 back\\slash \"quoted\"", "name": "caf\u00e9 <b>&amp;</b> 'q'", "nested": {"empty_list": [], "empty_map": {}, "list": [1, 2.5, true, null, "\u4e16\u754c \ud83d\ude42", -0.0001]}, "small": 1.5e-07, "whole": 3.0, "zebra": 1}
{"list":[1,2.5,true,null,"世界 🙂",-0.0001],"empty_list":[],"empty_map":{}}"#;
    assert_eq!(
        render(template, &[ChatMessage::user("x")], None).expect("renders"),
        expected
    );
}

#[test]
fn tools_and_tool_calls_reach_the_template() {
    let template = "{% for tool in tools %}{{ tool.function.name }}={{ tool | tojson }}\n{% endfor %}\
                    {% for call in messages[0].tool_calls %}{{ call.function.arguments | tojson }}{% endfor %}";
    // Keys are written in sorted order: serde_json::Value (without its
    // preserve_order feature) sorts object keys, so that is the order the
    // template receives; see tool_json_keeps_the_callers_key_order.
    let tools = serde_json::json!([
        {"function": {"description": "Look up <x> & y", "name": "lookup", "parameters": {"type": "object"}}, "type": "function"}
    ]);
    let mut message = ChatMessage::assistant("");
    message.tool_calls = Some(serde_json::json!([
        {"function": {"arguments": {"city": "Zürich", "days": 2}, "name": "lookup"}, "type": "function"}
    ]));
    let output = render(template, &[message], Some(&tools)).expect("renders");
    assert_eq!(
        output,
        "lookup={\"function\": {\"description\": \"Look up <x> & y\", \"name\": \"lookup\", \"parameters\": {\"type\": \"object\"}}, \"type\": \"function\"}\n\
         {\"city\": \"Zürich\", \"days\": 2}"
    );
}

#[test]
fn tool_json_keeps_the_callers_key_order() {
    // transformers renders tool schemas in the order the request gave them.
    let tools: serde_json::Value = serde_json::from_str(
        r#"[{"type": "function", "function": {"name": "f", "description": "d"}}]"#,
    )
    .expect("valid JSON");
    let output = render(
        "{{ tools[0] | tojson }}",
        &[ChatMessage::user("x")],
        Some(&tools),
    )
    .expect("renders");
    assert_eq!(
        output,
        r#"{"type": "function", "function": {"name": "f", "description": "d"}}"#
    );
}

#[test]
fn raise_exception_surfaces_the_templates_message() {
    let template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}ok";
    assert_eq!(
        render(template, &[ChatMessage::user("x")], None).expect("user first renders"),
        "ok"
    );
    let err = render(template, &[ChatMessage::assistant("x")], None).expect_err("template refuses");
    match &err {
        TokenizerError::ChatTemplateRaised { message } => {
            assert_eq!(
                message,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        }
        other => panic!("expected ChatTemplateRaised, got {other:?}"),
    }
    assert!(err.to_string().contains("roles must alternate"), "{err}");
}

#[test]
fn a_failing_template_reports_the_minijinja_error() {
    let err = render(
        "{{ messages[0].content.no_such_method() }}",
        &[ChatMessage::user("x")],
        None,
    )
    .expect_err("unknown method fails");
    match &err {
        TokenizerError::ChatTemplate { message } => assert!(
            message.contains("no_such_method") || message.contains("unknown method"),
            "{message}"
        ),
        other => panic!("expected ChatTemplate, got {other:?}"),
    }
}

#[test]
fn a_template_with_a_syntax_error_fails_at_load_naming_the_file() {
    let config = tiny_config_json("{% for message in messages %}{{ message.content }}");
    let err = Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect_err("unclosed for loop");
    match &err {
        TokenizerError::ChatTemplateSyntax {
            file,
            template,
            message,
        } => {
            assert_eq!(file, &PathBuf::from("<embedded tokenizer_config.json>"));
            assert_eq!(template, "default");
            assert!(message.contains("syntax error"), "{message}");
        }
        other => panic!("expected ChatTemplateSyntax, got {other:?}"),
    }
}

#[test]
fn pycompat_methods_and_strftime_now_are_available() {
    let template = "{{ messages[0].content.strip().split(',') | join('|') }} {{ messages[0].content.startswith(' a') }} {{ strftime_now('%Y') | length }}";
    let output = render(template, &[ChatMessage::user(" a,b ,c ")], None).expect("renders");
    assert_eq!(output, "a|b |c True 4");
}

#[test]
fn conditional_namespace_arguments_parse_as_in_jinja2() {
    // Tool-calling templates write `namespace(name=a if b else c)`. Older
    // minijinja could not parse a bare conditional as a keyword argument and
    // engines rewrote the template; minijinja 3 parses it, which this guards.
    let template = "{% set tcid = messages[0].name %}{% set ns = namespace(name=tcid if tcid else 'none', n=1) %}{{ ns.name }}/{{ ns.n }}";
    let mut named = ChatMessage::user("x");
    named.name = Some("call_7".to_string());
    assert_eq!(
        render(template, &[named], None).expect("renders"),
        "call_7/1"
    );
    assert_eq!(
        render(template, &[ChatMessage::user("x")], None).expect("renders"),
        "none/1"
    );
}

#[test]
fn named_templates_pick_tool_use_when_tools_are_given() {
    let config = serde_json::json!({
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "with {{ tools | length }} tools"}
        ]
    })
    .to_string();
    let tokenizer = Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect("loads");
    let messages = [ChatMessage::user("x")];
    assert_eq!(
        tokenizer
            .apply_chat_template(&messages, false, None)
            .expect("renders"),
        "plain"
    );
    let tools = serde_json::json!([{"type": "function"}]);
    assert_eq!(
        tokenizer
            .apply_chat_template(&messages, false, Some(&tools))
            .expect("renders"),
        "with 1 tools"
    );
}

#[test]
fn chat_message_json_accepts_null_content_and_omits_unset_fields() {
    let message: ChatMessage = serde_json::from_str(
        r#"{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}"#,
    )
    .expect("parses");
    assert_eq!(message.content, "");
    assert_eq!(message.name, None);
    let json = serde_json::to_string(&ChatMessage::user("hi")).expect("serializes");
    assert_eq!(json, r#"{"role":"user","content":"hi"}"#);
}

fn qwen3_fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen3")
}

/// Renders a conversation fixture (written by `render_reference.py`) with the
/// real Qwen3 template and compares with jinja2's output byte for byte.
fn assert_qwen3_renders_like_jinja2(name: &str) {
    let dir = qwen3_fixture_dir();
    let config = std::fs::read(dir.join("tokenizer_config.json")).expect("Qwen3 config fixture");
    let conversation: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join(format!("{name}.json"))).expect("conversation fixture"),
    )
    .expect("conversation is JSON");
    let expected =
        std::fs::read_to_string(dir.join(format!("{name}.expected.txt"))).expect("expected render");

    let messages: Vec<ChatMessage> =
        serde_json::from_value(conversation["messages"].clone()).expect("messages deserialize");
    let tools = conversation.get("tools");
    let add_generation_prompt = conversation["add_generation_prompt"]
        .as_bool()
        .expect("flag");

    // The chat template does not depend on the vocabulary, so the tiny
    // tokenizer stands in for Qwen3's 11 MB tokenizer.json. Qwen3's added-token
    // table names ids past 151k that the tiny vocabulary cannot have, so it goes.
    let mut config: serde_json::Value = serde_json::from_slice(&config).expect("config is JSON");
    config
        .as_object_mut()
        .expect("config is an object")
        .remove("added_tokens_decoder");
    let config = config.to_string();
    let tokenizer = Tokenizer::from_bytes(
        tiny_bpe_tokenizer_json().as_bytes(),
        Some(config.as_bytes()),
    )
    .expect("tiny tokenizer with the Qwen3 template loads");
    let rendered = tokenizer
        .apply_chat_template(&messages, add_generation_prompt, tools)
        .expect("renders");
    assert_eq!(rendered, expected);
}

#[test]
fn qwen3_template_with_tools_and_tool_calls_matches_jinja2() {
    assert_qwen3_renders_like_jinja2("conversation_with_tools");
}

#[test]
fn qwen3_template_multi_turn_with_thinking_matches_jinja2() {
    assert_qwen3_renders_like_jinja2("conversation_multi_turn");
}

fn qwen35_fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/qwen35")
}

/// Renders a conversation fixture with the real Qwen3.5 template (llama.cpp's
/// models/templates/Qwen3.5-4B.jinja) and compares with jinja2's output (written by
/// `render_reference.py`) byte for byte. Content given as a list of text parts is joined, as
/// the server does before the template sees it.
fn assert_qwen35_renders_like_jinja2(name: &str) {
    let dir = qwen35_fixture_dir();
    let source = std::fs::read_to_string(dir.join("chat_template.jinja")).expect("Qwen3.5 template fixture");
    let conversation: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.json"))).expect("conversation fixture")).expect("conversation is JSON");
    let expected = std::fs::read_to_string(dir.join(format!("{name}.expected.txt"))).expect("expected render");
    let mut messages = conversation["messages"].clone();
    for message in messages.as_array_mut().expect("a list of messages") {
        if let Some(parts) = message["content"].as_array() {
            let text: String = parts.iter().filter_map(|p| p["text"].as_str()).collect();
            message["content"] = serde_json::Value::String(text);
        }
    }
    let messages: Vec<ChatMessage> = serde_json::from_value(messages).expect("messages deserialize");
    let kwargs = conversation.get("chat_template_kwargs").and_then(|k| k.as_object()).cloned().unwrap_or_default();
    let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": source}).to_string();
    let tokenizer = Tokenizer::from_bytes(tiny_bpe_tokenizer_json().as_bytes(), Some(config.as_bytes())).expect("tiny tokenizer with the Qwen3.5 template loads");
    let add_generation_prompt = conversation["add_generation_prompt"].as_bool().expect("flag");
    let rendered = tokenizer.apply_chat_template_with(&messages, add_generation_prompt, conversation.get("tools"), &kwargs).expect("renders");
    assert_eq!(rendered, expected);
}

#[test]
fn qwen35_template_with_tools_tool_calls_and_results_matches_jinja2() {
    assert_qwen35_renders_like_jinja2("conversation_tools");
}

#[test]
fn qwen35_template_with_thinking_off_matches_jinja2() {
    assert_qwen35_renders_like_jinja2("conversation_thinking_off");
}

#[test]
fn qwen35_template_multi_turn_with_earlier_reasoning_matches_jinja2() {
    assert_qwen35_renders_like_jinja2("conversation_multi_turn_reasoning");
}

#[test]
fn qwen35_template_reasoning_of_tool_turns_matches_jinja2() {
    assert_qwen35_renders_like_jinja2("conversation_tool_turn_reasoning");
}

#[test]
fn template_kwargs_cannot_replace_the_conversation() {
    let template = "{{ messages | length }} {{ enable_thinking }}";
    let tokenizer = tiny_tokenizer_with_template(template);
    let kwargs = serde_json::json!({"messages": [], "enable_thinking": false});
    let rendered = tokenizer.apply_chat_template_with(&[ChatMessage::user("x")], false, None, kwargs.as_object().expect("object")).expect("renders");
    assert_eq!(rendered, "1 False");
}

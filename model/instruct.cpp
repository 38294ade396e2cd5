#include "model/instruct.hpp"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/files.hpp"

namespace troupe::model {

namespace {

std::string in_quotes(std::string_view s) { return "\"" + std::string(s) + "\""; }

// "a number" / "an object" ... for messages about a field of the wrong type.
std::string a_type(const nlohmann::json& j) {
  const std::string t = j.type_name();
  return (t == "object" || t == "array" ? "an " : "a ") + t;
}

std::string trim(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  const auto e = s.find_last_not_of(ws);
  return std::string(s.substr(b, e - b + 1));
}

}  // namespace

core::result<chat_template> parse_template(std::string_view name) {
  if (name == "plain") return chat_template::plain;
  if (name == "llama3") return chat_template::llama3;
  return core::error::make("unknown chat template " + in_quotes(name), "data.template is \"plain\" or \"llama3\"");
}

const char* template_name(chat_template t) { return t == chat_template::llama3 ? "llama3" : "plain"; }

parsed_record parse_record(std::string_view line) {
  parsed_record r;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 5: ..." -> from "column".
    if (auto at = what.find("column"); at != std::string::npos) what = what.substr(at);
    r.problem = "invalid JSON (" + what + ")";
    r.invalid_json = true;
    return r;
  }
  if (!j.is_object()) {
    r.problem = "the record is " + a_type(j) + ", expected a JSON object";
    return r;
  }
  auto string_field = [&](const nlohmann::json& obj, const char* key, const std::string& where,
                          std::string& out) {
    auto it = obj.find(key);
    if (it == obj.end()) {
      r.problem = "missing field " + in_quotes(key) + where;
      return false;
    }
    if (!it->is_string()) {
      r.problem = "field " + in_quotes(key) + where + " is " + a_type(*it) + ", expected a string";
      return false;
    }
    out = it->get<std::string>();
    return true;
  };
  if (auto m = j.find("messages"); m != j.end()) {
    if (!m->is_array() || m->empty()) {
      r.problem = "field \"messages\" is " + (m->is_array() ? std::string("empty") : a_type(*m)) +
                  ", expected an array of {\"role\", \"content\"} objects";
      return r;
    }
    bool assistant = false;
    for (std::size_t i = 0; i < m->size(); ++i) {
      const auto& msg = (*m)[i];
      const std::string where = " in message " + std::to_string(i + 1);
      if (!msg.is_object()) {
        r.problem = "message " + std::to_string(i + 1) + " is " + a_type(msg) +
                    ", expected a {\"role\", \"content\"} object";
        return r;
      }
      chat_message cm;
      if (!string_field(msg, "role", where, cm.role) ||
          !string_field(msg, "content", where, cm.content))
        return r;
      if (cm.role != "system" && cm.role != "user" && cm.role != "assistant") {
        r.problem = "message " + std::to_string(i + 1) + " has role " + in_quotes(cm.role) +
                    "; roles are system, user and assistant";
        return r;
      }
      assistant = assistant || cm.role == "assistant";
      r.chat.push_back(std::move(cm));
    }
    if (!assistant) {
      r.problem = "no assistant message: nothing to train on";
      r.chat.clear();
    }
    return r;
  }
  chat_message user{"user", {}}, reply{"assistant", {}};
  if (!string_field(j, "prompt", "", user.content) || !string_field(j, "response", "", reply.content)) {
    r.problem += " (a record is {\"prompt\", \"response\"} or {\"messages\": [...]})";
    return r;
  }
  r.chat = {std::move(user), std::move(reply)};
  return r;
}

std::vector<segment> render(chat_template t, const std::vector<chat_message>& chat) {
  using k = segment::kind;
  std::vector<segment> out;
  if (t == chat_template::plain) {
    for (const chat_message& m : chat) {
      if (m.role == "assistant") {
        out.push_back({k::text, m.content, true});
        out.push_back({k::eos, {}, true});
      } else {
        out.push_back({k::text, m.content + "\n", false});
      }
    }
    return out;
  }
  out.push_back({k::special, "<|begin_of_text|>", false});
  for (const chat_message& m : chat) {
    const bool trained = m.role == "assistant";
    out.push_back({k::special, "<|start_header_id|>", false});
    out.push_back({k::text, m.role, false});
    out.push_back({k::special, "<|end_header_id|>", false});
    out.push_back({k::text, "\n\n", false});
    out.push_back({k::text, trim(m.content), trained});
    out.push_back({k::special, "<|eot_id|>", trained});
  }
  return out;
}

core::result<example> encode_example(const std::vector<segment>& segs, const token_codec& codec) {
  example e;
  for (const segment& s : segs) {
    std::vector<int> ids;
    switch (s.what) {
      case segment::kind::text:
        if (!s.text.empty()) ids = codec.encode(s.text);
        break;
      case segment::kind::special: {
        auto id = codec.special(s.text);
        if (!id)
          return core::error::make("the template needs the special token " + s.text + ", which " +
                                       codec.name + " does not have",
                                   "use the tokenizer of the model the template is for (LLaMA-3's "
                                   "for data.template = \"llama3\"), or data.template = \"plain\"");
        ids = {*id};
        break;
      }
      case segment::kind::eos:
        if (codec.eos < 0)
          return core::error::make("the template ends each response with the end-of-text token, "
                                   "which " + codec.name + " does not name",
                                   "use a tokenizer with an EOS token (tokenizer_config.json's "
                                   "eos_token)");
        ids = {codec.eos};
        break;
    }
    for (int id : ids) {
      e.ids.push_back(id);
      e.mask.push_back(s.trained ? 1 : 0);
    }
  }
  return e;
}

bool row_builder::add(example e, bool* truncated) {
  const auto L = static_cast<std::size_t>(L_);
  if (truncated) *truncated = e.ids.size() > L;
  if (e.ids.size() > L) {
    e.ids.resize(L);
    e.mask.resize(L);
  }
  if (e.ids.empty()) return false;
  e.mask[0] = 0;  // an example's first token is never predicted from what stands before it
  bool any = false;
  for (std::uint8_t m : e.mask) any = any || m != 0;
  if (!any) return false;
  const int n = static_cast<int>(e.ids.size());
  if (used_ > 0 && (!packing_ || used_ + n > L_)) pad_open_row();
  ids_.insert(ids_.end(), e.ids.begin(), e.ids.end());
  mask_.insert(mask_.end(), e.mask.begin(), e.mask.end());
  starts_.push_back(1);
  starts_.insert(starts_.end(), static_cast<std::size_t>(n - 1), 0);
  used_ += n;
  if (used_ == L_) used_ = 0;
  return true;
}

void row_builder::pad_open_row() {
  if (used_ == 0) return;
  ids_.insert(ids_.end(), static_cast<std::size_t>(L_ - used_), pad_);
  mask_.insert(mask_.end(), static_cast<std::size_t>(L_ - used_), 0);
  starts_.insert(starts_.end(), static_cast<std::size_t>(L_ - used_), 0);  // the example's padding
  used_ = 0;
}

void row_builder::finish() { pad_open_row(); }

core::result<prepared_rows> prepare_instructions(const std::vector<std::string>& files,
                                                 const instruct_options& opt,
                                                 const token_codec& codec) {
  const int L = opt.seq_length + 1;
  prepared_rows out{row_builder(L, opt.packing, codec.pad), row_builder(L, opt.packing, codec.pad),
                    {}, {}};
  prepare_counts& n = out.counts;
  core::input_spec spec;
  spec.what = "JSONL file";
  spec.max_bytes = std::uint64_t(1) << 34;
  spec.hint = "--input takes JSON-lines files of {\"prompt\", \"response\"} or {\"messages\"} records";
  for (const std::string& file : files) {
    auto text = core::read_input(file, spec);
    if (!text) return text.err();
    std::string_view all = text.value();
    std::int64_t line_no = 0;
    for (std::size_t pos = 0; pos < all.size();) {
      const std::size_t end = std::min(all.find('\n', pos), all.size());
      std::string_view line = all.substr(pos, end - pos);
      pos = end + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
      ++n.records;
      parsed_record rec = parse_record(line);
      if (!rec.ok()) {
        ++(rec.invalid_json ? n.invalid_json : n.bad_fields);
        out.problems.push_back({file, line_no, rec.problem});
        continue;
      }
      auto ex = encode_example(render(opt.tmpl, rec.chat), codec);
      auto at_line = [&](std::string message, std::string hint) {
        core::error e = core::error::at_file(file, std::move(message), std::move(hint));
        e.where.line = static_cast<int>(line_no);
        return e;
      };
      if (!ex) return at_line(ex.err().message, ex.err().hint);
      for (std::size_t i = 0; i < ex->ids.size(); ++i)
        if (opt.vocab_size > 0 && ex->ids[i] >= opt.vocab_size)
          return at_line("token id " + std::to_string(ex->ids[i]) +
                             " is not below model.vocab_size " + std::to_string(opt.vocab_size),
                         "prepare with the model's tokenizer (data.tokenizer_dir), or raise "
                         "model.vocab_size");
      std::size_t first_trained = 1;
      while (first_trained < ex->mask.size() && ex->mask[first_trained] == 0) ++first_trained;
      const auto kept_index = static_cast<double>(n.kept);
      const bool to_val = std::floor((kept_index + 1) * opt.val_fraction) >
                          std::floor(kept_index * opt.val_fraction);
      bool truncated = false;
      const std::int64_t tokens = static_cast<std::int64_t>(ex->ids.size());
      if (!(to_val ? out.val : out.train).add(std::move(ex.value()), &truncated)) {
        ++n.too_long;
        out.problems.push_back(
            {file, line_no,
             "prompt too long: its " + std::to_string(first_trained) +
                 " tokens (with the template) leave the response no position in a row of " +
                 std::to_string(L) + " tokens (seq_length " + std::to_string(opt.seq_length) +
                 "; the record has " + std::to_string(tokens) + ")"});
        continue;
      }
      ++n.kept;
      n.truncated += truncated;
    }
  }
  out.train.finish();
  out.val.finish();
  n.rows = out.train.rows() + out.val.rows();
  for (const auto* b : {&out.train, &out.val})
    for (std::size_t i = 0; i < b->mask().size(); ++i)
      n.trained += (i % static_cast<std::size_t>(L) != 0) && b->mask()[i] != 0;
  return out;
}

}  // namespace troupe::model

#include "flag_docs.hpp"

#include <algorithm>

namespace ddprun::docs {
namespace {

bool optional_value(const FlagSpec& f) {
  return f.metavar.size() >= 2 && f.metavar.front() == '[' && f.metavar.back() == ']';
}
bool takes_value(const FlagSpec& f) { return f.kind != FlagKind::boolean && !optional_value(f); }
bool file_valued(const FlagSpec& f) { return f.metavar == "FILE" || f.metavar == "PATH"; }
bool dir_valued(const FlagSpec& f) { return f.metavar == "DIR"; }

std::vector<const FlagSpec*> visible(std::span<const FlagSpec> flags) {
  std::vector<const FlagSpec*> out;
  for (const auto& f : flags) {
    if (!f.hidden) out.push_back(&f);
  }
  return out;
}

std::string upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    if (c == '-') c = '_';
  }
  return out;
}

std::vector<std::string_view> split_lines(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    lines.push_back(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return lines;
}

// ---- roff ----

// Text for a roff input line: backslashes and hyphens escaped (a hyphen in an option name must
// stay a minus sign to be copied), and a leading control character neutralised.
std::string roff(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '\\') {
      out += "\\e";
    } else if (c == '-') {
      out += "\\-";
    } else {
      out += c;
    }
  }
  if (!out.empty() && (out.front() == '.' || out.front() == '\'')) out.insert(0, "\\&");
  return out;
}

std::string bold(std::string_view s) { return "\\fB" + roff(s) + "\\fR"; }
std::string italic(std::string_view s) { return "\\fI" + roff(s) + "\\fR"; }

// Paragraphs, literal lines ("  ..."), bullets ("- ...") of a Section body.
std::string roff_body(std::string_view body) {
  std::string out;
  enum class Mode { none, para, literal, bullet } mode = Mode::none;
  for (std::string_view line : split_lines(body)) {
    if (line.empty()) {
      if (mode == Mode::literal) out += ".fi\n.RE\n";
      mode = Mode::none;
      continue;
    }
    if (line.starts_with("  ")) {
      if (mode != Mode::literal) out += ".PP\n.RS 4\n.nf\n";
      mode = Mode::literal;
      out += roff(line.substr(2)) + "\n";
      continue;
    }
    if (mode == Mode::literal) out += ".fi\n.RE\n";
    if (line.starts_with("- ")) {
      out += ".IP \\(bu 2\n" + roff(line.substr(2)) + "\n";
      mode = Mode::bullet;
      continue;
    }
    if (line.starts_with("= ")) {  // a term; the lines up to the next blank one describe it
      out += ".TP\n" + bold(line.substr(2)) + "\n";
      mode = Mode::bullet;
      continue;
    }
    if (mode == Mode::none) out += ".PP\n";
    if (mode == Mode::literal) out += ".PP\n";
    mode = mode == Mode::bullet ? Mode::bullet : Mode::para;
    out += roff(line) + "\n";
  }
  if (mode == Mode::literal) out += ".fi\n.RE\n";
  return out;
}

std::string roff_flags(const CommandDoc& cmd) {
  std::string out = ".TP\n" + bold("-h") + ", " + bold("--help") + "\nPrint this help message and exit.\n";
  for (const FlagSpec* f : visible(cmd.flags)) {
    std::string tag;
    for (const auto& s : spellings(*f, cmd.underscore_spellings)) tag += (tag.empty() ? "" : ", ") + bold(s);
    if (!f->metavar.empty()) tag += " " + italic(f->metavar);
    std::string text = help_with_default(*f);
    if (f->env_form) text += " Environment: " + pet_variable(f->dash) + ".";
    out += ".TP\n" + tag + "\n" + roff(text) + "\n";
  }
  return out;
}

// ---- shell quoting ----

// 'text' for sh; a single quote becomes '\''.
std::string sq(std::string_view text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string join(const std::vector<std::string>& words, std::string_view sep) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : std::string(sep)) + w;
  return out;
}

std::string fn_name(std::string_view name) {
  std::string out = "_";
  for (char c : name) out += (c == '-' ? '_' : c);
  return out;
}

// ---- bash ----

// The case arm that completes the value of each flag that has a value set or a file type.
std::string bash_value_cases(const CommandDoc& cmd) {
  std::string out;
  for (const FlagSpec* f : visible(cmd.flags)) {
    if (!takes_value(*f) && !optional_value(*f)) continue;
    std::string action;
    if (!f->choices.empty()) {
      std::vector<std::string> words(f->choices.begin(), f->choices.end());
      action = "_ddprun_docs_words " + sq(join(words, " ")) + " \"$cur\"";
    } else if (file_valued(*f)) {
      action = "_ddprun_docs_files -f \"$cur\"";
    } else if (dir_valued(*f)) {
      action = "_ddprun_docs_files -d \"$cur\"";
    } else {
      continue;  // free-form value: nothing to offer
    }
    out += "      " + join(spellings(*f, cmd.underscore_spellings), "|") + ") " + action + " ;;\n";
  }
  return out;
}

std::string bash_flag_words(const CommandDoc& cmd) {
  std::vector<std::string> words{"-h", "--help"};
  for (const FlagSpec* f : visible(cmd.flags)) {
    for (auto& s : spellings(*f, cmd.underscore_spellings)) words.push_back(std::move(s));
  }
  return join(words, " ");
}

std::string bash_value_flags(const CommandDoc& cmd) {
  std::vector<std::string> words;
  for (const FlagSpec& f : cmd.flags) {
    // Hidden value flags too: they still consume the next word when the walk meets them.
    if (!takes_value(f)) continue;
    for (auto& s : spellings(f, cmd.underscore_spellings)) words.push_back(std::move(s));
  }
  return " " + join(words, " ") + " ";
}

// One completion function body for a command: walk the words before the cursor (flags and their
// values; the first other word is the program), then complete a value, a flag or a file.
std::string bash_command_fn(const std::string& fn, const CommandDoc& cmd, int first_word,
                            const std::vector<CommandDoc>& subcommands) {
  std::string out = fn + "() {\n";
  out += "  local cur=$1 cword=$2 i=" + std::to_string(first_word) + " w flag=\n";
  out += "  local value_flags=" + sq(bash_value_flags(cmd)) + "\n";
  out +=
      "  while (( i < cword )); do\n"
      "    w=${COMP_WORDS[i]}\n";
  if (cmd.takes_program) {
    out +=
        "    if [[ $w == -- ]]; then\n"
        "      (( i + 1 < cword )) && return 0  # past the program: its own arguments\n"
        "      _ddprun_docs_files -f \"$cur\"; return 0\n"
        "    fi\n";
  }
  out +=
      "    if [[ $w == -* ]]; then\n"
      "      if [[ ${COMP_WORDS[i+1]} == = ]]; then (( i += 3 )); continue; fi\n"
      "      if [[ $w != *=* && $value_flags == *\" $w \"* ]]; then (( i += 2 )); continue; fi\n"
      "      (( i += 1 )); continue\n"
      "    fi\n";
  if (cmd.takes_program) {
    out += "    return 0  # a program word: everything after it is the program's\n";
  } else {
    out += "    (( i += 1 ))\n";
  }
  out += "  done\n";
  // The value of a flag: "--flag VALUE", "--flag=VALUE" (one word, or split at '=' by
  // COMP_WORDBREAKS into "--flag" "=" "VALUE").
  out +=
      "  local prefix=\n"
      "  if [[ $cur == = ]]; then flag=${COMP_WORDS[cword-1]}; cur=\n"
      "  elif (( cword >= 2 )) && [[ ${COMP_WORDS[cword-1]} == = ]]; then flag=${COMP_WORDS[cword-2]}\n"
      "  elif [[ $cur == --*=* ]]; then flag=${cur%%=*}; prefix=$flag=; cur=${cur#*=}\n"
      "  elif (( cword > " +
      std::to_string(first_word) +
      " )) && [[ $value_flags == *\" ${COMP_WORDS[cword-1]} \"* ]]; then flag=${COMP_WORDS[cword-1]}\n"
      "  fi\n"
      "  if [[ -n $flag ]]; then\n"
      "    case $flag in\n" +
      bash_value_cases(cmd) +
      "    esac\n"
      "    if [[ -n $prefix ]]; then COMPREPLY=(\"${COMPREPLY[@]/#/$prefix}\"); fi\n"
      "    return 0\n"
      "  fi\n"
      "  if [[ $cur == -* ]]; then\n"
      "    _ddprun_docs_words " +
      sq(bash_flag_words(cmd)) +
      " \"$cur\"\n"
      "    return 0\n"
      "  fi\n";
  if (cmd.takes_program) {
    std::vector<std::string> subs;
    for (const auto& s : subcommands) subs.emplace_back(s.name);
    if (!subs.empty()) {
      out += "  if (( cword == " + std::to_string(first_word) +
             " )); then\n"
             "    _ddprun_docs_words " +
             sq(join(subs, " ")) +
             " \"$cur\"\n"
             "  fi\n";
    }
    out += "  _ddprun_docs_files -f \"$cur\" append\n";
  }
  out += "  return 0\n}\n\n";
  return out;
}

// ---- zsh ----

// A description inside _arguments' [...]: first sentence, brackets and colons escaped.
std::string zsh_desc(std::string_view help) {
  std::string_view first = help;
  if (const auto dot = help.find(". "); dot != std::string_view::npos) first = help.substr(0, dot + 1);
  if (first.size() > 110) first = first.substr(0, 107);
  std::string out;
  for (char c : first) {
    if (c == '[' || c == ']' || c == ':' || c == '\\') out += '\\';
    out += c;
  }
  if (help.size() > first.size() && first.size() == 107) out += "...";
  return out;
}

std::string zsh_escape_colons(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == ':' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

std::string zsh_specs(const CommandDoc& cmd) {
  std::vector<std::string> specs{"'(- *)'{-h,--help}'[print help and exit]'"};
  for (const FlagSpec* f : visible(cmd.flags)) {
    const auto names = spellings(*f, cmd.underscore_spellings);
    const std::string excl = "(" + join(names, " ") + ")";
    std::string head = f->kind == FlagKind::repeated ? "*" : excl;
    std::string desc = "[" + zsh_desc(f->help) + "]";
    std::string arg;
    if (takes_value(*f) || optional_value(*f)) {
      std::string meta = std::string(f->metavar);
      if (optional_value(*f)) meta = meta.substr(1, meta.size() - 2);
      std::string action = " ";
      if (!f->choices.empty()) {
        std::vector<std::string> words(f->choices.begin(), f->choices.end());
        action = "(" + join(words, " ") + ")";
      } else if (file_valued(*f)) {
        action = "_files";
      } else if (dir_valued(*f)) {
        action = "_files -/";
      }
      arg = (optional_value(*f) ? "::" : ":") + zsh_escape_colons(meta) + ":" + action;
    }
    for (const auto& name : names) {
      const std::string eq = (takes_value(*f) || optional_value(*f)) && name.starts_with("--") ? "=" : "";
      specs.push_back(sq(head + name + eq + desc + arg));
    }
  }
  return join(specs, " \\\n    ");
}

}  // namespace

std::vector<std::string> spellings(const FlagSpec& spec, bool underscore) {
  std::vector<std::string> out;
  if (!spec.short_name.empty()) out.push_back("-" + std::string(spec.short_name));
  out.push_back("--" + std::string(spec.dash));
  if (underscore && underscore_spelling(spec.dash) != spec.dash) out.push_back("--" + underscore_spelling(spec.dash));
  return out;
}

std::string render_man(const PageDoc& page) {
  const CommandDoc& cmd = page.command;
  std::string out = ".\\\" Generated by gen_docs from the flag table of " + std::string(cmd.name) + "; do not edit.\n";
  out += ".TH " + upper(cmd.name) + " " + std::to_string(page.section) + " \"\" \"" + roff(cmd.name) + " " +
         roff(page.version) + "\" \"" + std::string(page.manual) + "\"\n";
  out += ".nh\n.ad l\n";
  out += ".SH NAME\n" + roff(cmd.name) + " \\- " + roff(page.summary) + "\n";
  out += ".SH SYNOPSIS\n" + bold(cmd.name) + " " + roff(cmd.synopsis) + "\n";
  for (const auto& sub : page.subcommands) {
    out += ".br\n" + bold(std::string(cmd.name) + " " + std::string(sub.name)) + " " + roff(sub.synopsis) + "\n";
  }
  out += ".SH DESCRIPTION\n" + roff_body(cmd.description);
  out += ".SH OPTIONS\n" + roff_flags(cmd);
  if (!page.subcommands.empty()) {
    out += ".SH COMMANDS\n";
    for (const auto& sub : page.subcommands) {
      out += ".SS \"" + roff(std::string(cmd.name) + " " + std::string(sub.name)) + "\"\n";
      out += roff_body(sub.description);
      out += ".PP\nOptions of " + bold(std::string(cmd.name) + " " + std::string(sub.name)) + ":\n";
      out += roff_flags(sub);
    }
  }
  for (const auto& s : page.sections) out += ".SH " + roff(s.title) + "\n" + roff_body(s.body);
  return out;
}

std::string render_bash_completion(const PageDoc& page) {
  const CommandDoc& cmd = page.command;
  const std::string fn = fn_name(cmd.name);
  std::string out = "# bash completion for " + std::string(cmd.name) + "\n";
  out += "# Generated by gen_docs from the flag table of " + std::string(cmd.name) + "; do not edit.\n\n";
  // The helpers are shared by every generated script (same definitions), so sourcing two is fine.
  out +=
      "_ddprun_docs_words() {  # WORDS CUR: the words that start with CUR\n"
      "  local IFS=$' \\t\\n'\n"
      "  COMPREPLY=($(compgen -W \"$1\" -- \"$2\"))\n"
      "}\n"
      "_ddprun_docs_files() {  # -f|-d CUR [append]: file or directory names\n"
      "  local line\n"
      "  [[ $3 == append ]] || COMPREPLY=()\n"
      "  while IFS= read -r line; do COMPREPLY+=(\"$line\"); done < <(compgen \"$1\" -- \"$2\")\n"
      "  compopt -o filenames 2>/dev/null\n"
      "  return 0\n"
      "}\n\n";
  out += bash_command_fn(fn + "_main", cmd, 1, page.subcommands);
  for (const auto& sub : page.subcommands) out += bash_command_fn(fn + "_" + std::string(sub.name), sub, 2, {});
  out += fn +
         "() {\n"
         "  COMPREPLY=()\n"
         "  local cur=${COMP_WORDS[COMP_CWORD]}\n";
  for (const auto& sub : page.subcommands) {
    out += "  if (( COMP_CWORD > 1 )) && [[ ${COMP_WORDS[1]} == " + std::string(sub.name) +
           " ]]; then\n"
           "    " +
           fn + "_" + std::string(sub.name) +
           " \"$cur\" \"$COMP_CWORD\"; return 0\n"
           "  fi\n";
  }
  out += "  " + fn +
         "_main \"$cur\" \"$COMP_CWORD\"\n"
         "}\n"
         "complete -F " +
         fn + " " + std::string(cmd.name) + "\n";
  return out;
}

std::string render_zsh_completion(const PageDoc& page) {
  const CommandDoc& cmd = page.command;
  const std::string fn = fn_name(cmd.name);
  std::string out = "#compdef " + std::string(cmd.name) + "\n";
  out += "# zsh completion for " + std::string(cmd.name) + ".\n";
  out += "# Generated by gen_docs from the flag table of " + std::string(cmd.name) + "; do not edit.\n\n";
  for (const auto& sub : page.subcommands) {
    out += fn + "_" + std::string(sub.name) + "() {\n  _arguments -s -S : \\\n    " + zsh_specs(sub) + "\n}\n\n";
  }
  if (cmd.takes_program) {
    out += fn + "_program() {\n";
    for (const auto& sub : page.subcommands) {
      out += "  compadd -X 'command' -- " + sq(sub.name) + "\n";
    }
    out += "  _files\n}\n\n";
  }
  out += fn + "() {\n";
  for (const auto& sub : page.subcommands) {
    out += "  if (( CURRENT > 2 )) && [[ $words[2] == " + std::string(sub.name) +
           " ]]; then\n"
           "    shift words; (( CURRENT-- )); " +
           fn + "_" + std::string(sub.name) +
           "; return\n"
           "  fi\n";
  }
  out += "  _arguments -s -S";
  if (cmd.takes_program) out += " -A '-*'";
  out += " : \\\n    " + zsh_specs(cmd);
  if (cmd.takes_program) {
    out += " \\\n    '1:program:" + fn + "_program' \\\n    '*::program arguments:_normal'";
  }
  out += "\n}\n\n" + fn + " \"$@\"\n";
  return out;
}

}  // namespace ddprun::docs

#include "ddprun/launcher/slurm.hpp"

#include <algorithm>
#include <initializer_list>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::launcher {
namespace {

constexpr std::string_view kHostlistForms =
    "comma list of names, each with optional [..] groups of N or LO-HI ranges, e.g. node[01-04,07],gpu-a[1-2]";

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

class HostlistParser {
 public:
  HostlistParser(std::string_view text, std::string_view what, const HostlistLimits& limits)
      : text_(text), what_(what), limits_(limits) {}

  std::vector<std::string> run() {
    std::vector<std::string> out;
    skip_space();
    if (pos_ >= text_.size()) fail(0, "empty host list");
    while (true) {
      skip_space();
      expand_name(out);
      skip_space();
      if (pos_ >= text_.size()) break;
      if (text_[pos_] != ',') fail(pos_, std::string("unexpected '") + text_[pos_] + "'");
      ++pos_;
    }
    return out;
  }

 private:
  [[noreturn]] void fail(std::size_t at, const std::string& why) const {
    throw UsageError(std::string(what_) + "=" + std::string(text_) + ": " + why + " at position " + std::to_string(at),
                     "accepted forms: " + std::string(kHostlistForms));
  }

  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n')) ++pos_;
  }

  // One name with its bracket groups, up to the next top-level ',' or the end.
  void expand_name(std::vector<std::string>& out) {
    const std::size_t start = pos_;
    std::vector<std::string> partial{""};
    std::size_t longest = 0;  // of the names in `partial`
    bool any = false;
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == ',' || c == ' ' || c == '\t' || c == '\n') break;
      if (c == ']') fail(pos_, "']' without '['");
      if (c == '[') {
        const auto values = parse_group();
        if (partial.size() * values.size() > limits_.max_hosts) fail(start, "too many hosts");
        std::size_t widest = 0;
        for (const auto& v : values) widest = std::max(widest, v.size());
        longest += widest;
        check_size(start, longest, partial.size() * values.size());
        std::vector<std::string> next;
        next.reserve(partial.size() * values.size());
        for (const auto& p : partial) {
          for (const auto& v : values) next.push_back(p + v);
        }
        partial = std::move(next);
      } else {
        check_size(start, ++longest, partial.size());
        for (auto& p : partial) p.push_back(c);
        ++pos_;
      }
      any = true;
    }
    if (!any) fail(start, "empty host name");
    if (out.size() + partial.size() > limits_.max_hosts) fail(start, "too many hosts");
    for (auto& p : partial) {
      bytes_ += p.size();
      out.push_back(std::move(p));
    }
  }

  // A name of `longest` bytes at most, `count` of them, on top of what is expanded already: within
  // a host name's length and the list's total (a short list whose names are long multiplies out).
  void check_size(std::size_t start, std::size_t longest, std::size_t count) const {
    if (longest > kMaxHostlistNameBytes) {
      fail(start, "a host name longer than " + std::to_string(kMaxHostlistNameBytes) + " bytes");
    }
    if (bytes_ + longest * count > limits_.max_bytes) {
      fail(start, "the names take more than " + std::to_string(limits_.max_bytes >> 20) + " MiB");
    }
  }

  // "[a-b,c]" at pos_ -> the values, padded.
  std::vector<std::string> parse_group() {
    const std::size_t open = pos_;
    const auto close = text_.find(']', pos_);
    if (close == std::string_view::npos) fail(open, "'[' without ']'");
    const auto nested = text_.find('[', pos_ + 1);
    if (nested != std::string_view::npos && nested < close) fail(nested, "nested '['");
    const std::string_view body = text_.substr(pos_ + 1, close - pos_ - 1);
    if (body.empty()) fail(open, "empty '[]'");
    std::vector<std::string> values;
    std::size_t item_start = pos_ + 1;
    for (const auto& item : split(body, ',')) {
      const std::size_t at = item_start;
      item_start += item.size() + 1;
      if (item.empty()) fail(at, "empty range in '[...]'");
      const auto dash = item.find('-');
      const std::string lo_text = item.substr(0, dash);
      const std::string hi_text = dash == std::string::npos ? lo_text : item.substr(dash + 1);
      if (!is_digits(lo_text) || !is_digits(hi_text) || lo_text.size() > 18 || hi_text.size() > 18) {
        fail(at, "'" + item + "' is not N or LO-HI");
      }
      const auto lo = *parse_int(lo_text);
      const auto hi = *parse_int(hi_text);
      if (hi < lo) fail(at, "range '" + item + "' runs backwards");
      if (static_cast<std::uint64_t>(hi - lo) >= limits_.max_hosts ||
          values.size() + static_cast<std::size_t>(hi - lo) >= limits_.max_hosts) {
        fail(at, "too many hosts");
      }
      const std::size_t width = lo_text.size();
      for (auto v = lo; v <= hi; ++v) {
        std::string s = std::to_string(v);
        if (s.size() < width) s.insert(0, width - s.size(), '0');
        values.push_back(std::move(s));
      }
    }
    pos_ = close + 1;
    return values;
  }

  std::string_view text_;
  std::string_view what_;
  HostlistLimits limits_;
  std::size_t pos_ = 0;
  std::size_t bytes_ = 0;  // of the names in the output so far
};

const std::string* find(const std::map<std::string, std::string>& env, const std::string& name) {
  const auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

// The first of `names` that is set; its name goes to `which`.
const std::string* first_set(const std::map<std::string, std::string>& env, std::initializer_list<const char*> names,
                             std::string& which) {
  for (const char* name : names) {
    if (const std::string* v = find(env, name)) {
      which = name;
      return v;
    }
  }
  return nullptr;
}

int env_int(const std::string& name, const std::string& value, int min) {
  const std::string_view t = trim(value);
  const auto v = parse_int(t);
  if (!is_digits(t) || !v || *v < min || *v > 1'000'000) {
    throw UsageError(name + "=" + value + ": not an integer >= " + std::to_string(min),
                     "is this a Slurm job step? unset SLURM_JOB_ID to launch without Slurm");
  }
  return static_cast<int>(*v);
}

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view text, std::string_view what, const HostlistLimits& limits) {
  return HostlistParser(text, what, limits).run();
}

bool slurm_step(const std::map<std::string, std::string>& env) {
  return find(env, "SLURM_STEP_ID") != nullptr || find(env, "SLURM_STEP_NODELIST") != nullptr ||
         find(env, "SLURM_STEP_NUM_NODES") != nullptr;
}

std::optional<SlurmSettings> slurm_from_env(const std::map<std::string, std::string>& env,
                                            const HostlistLimits& limits) {
  const std::string* job_id = find(env, "SLURM_JOB_ID");
  if (job_id == nullptr) return std::nullopt;
  // Only an srun step runs one task per node: srun sets the SLURM_STEP_* variables. A batch
  // script (sbatch) runs on the first node only, with SLURM_NODEID=0 and the whole allocation's
  // SLURM_NNODES: taken for a step, its ddprun waited for nodes that never came.
  if (!slurm_step(env)) return std::nullopt;
  // The step's node count first (an interactive step, or srun -N, uses fewer than the job).
  std::string nnodes_var;
  const std::string* nnodes =
      first_set(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"}, nnodes_var);
  if (nnodes == nullptr) return std::nullopt;

  SlurmSettings s;
  const std::string job(trim(*job_id));
  if (job.empty() || job.find_first_of(" \t/") != std::string::npos) {
    throw UsageError("SLURM_JOB_ID=" + *job_id + ": not a job id", "unset SLURM_JOB_ID to launch without Slurm");
  }
  s.nnodes = env_int(nnodes_var, *nnodes, 1);
  const std::string* node_id = find(env, "SLURM_NODEID");
  if (node_id == nullptr) return std::nullopt;  // not a step's task: no node of its own
  s.node_id = env_int("SLURM_NODEID", *node_id, 0);
  if (s.node_id >= s.nnodes) {
    throw UsageError("SLURM_NODEID=" + *node_id + " is not below " + nnodes_var + "=" + *nnodes,
                     "the Slurm environment is inconsistent; run ddprun under srun");
  }
  std::string list_var;
  const std::string* list = first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}, list_var);
  if (list == nullptr) {
    throw UsageError("SLURM_JOB_ID is set but none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is",
                     "run ddprun under srun, or unset SLURM_JOB_ID");
  }
  const auto hosts = expand_hostlist(*list, list_var, limits);
  if (hosts.size() != static_cast<std::size_t>(s.nnodes)) {
    throw UsageError(list_var + "=" + *list + " names " + std::to_string(hosts.size()) + " node(s) but " + nnodes_var +
                         "=" + *nnodes,
                     "the Slurm environment is inconsistent; run ddprun under srun with one task per node");
  }
  s.first_host = hosts.front();
  s.run_id = "slurm-" + job;
  if (const std::string* step = find(env, "SLURM_STEP_ID"); step != nullptr && !trim(*step).empty()) {
    s.run_id += "." + std::string(trim(*step));
  }
  return s;
}

}  // namespace ddprun::launcher

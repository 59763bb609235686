// quantkit's scorer over llama.cpp's own kernels, for `quantkit eval --backend llama.cpp` (llama_cpp_backend.py).
//
// llama-perplexity tokenises text itself and scores only the second half of each chunk, so it cannot score the
// token windows eval scores with every other engine; this program takes the token ids as they are. Built and
// linked against the static llama.cpp libraries by bench/llama_cpp_build.sh.
//
//   quantkit-llama-score MODEL.gguf --ctx N [--threads T]
// stdin, one request a line; stdout, one JSON line each, in order:
//   score t0 t1 ... tn-1   -> {"nll": [-log p(t_i | t_<i) for i = 1..n-1], "sum": their sum, "n": n-1,
//                              "top": [argmax after t_<=i for i = 0..n-2]}
//   greedy K t0 ... tn-1   -> {"greedy": K argmax tokens after the prompt, "margins": top-1 minus top-2 log-prob}
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Dist {
    double logz;  // log of the softmax's normaliser
    int top;
    double margin;
};

// The normaliser in double: at 49k+ vocabulary entries a float sum loses the digits eval compares on.
Dist dist(const float* logits, int n_vocab) {
    int top = 0, second = -1;
    for (int v = 1; v < n_vocab; ++v) {
        if (logits[v] > logits[top]) {
            second = top;
            top = v;
        } else if (second < 0 || logits[v] > logits[second]) {
            second = v;
        }
    }
    double sum = 0.0;
    for (int v = 0; v < n_vocab; ++v) sum += std::exp(double(logits[v]) - double(logits[top]));
    return {double(logits[top]) + std::log(sum), top, double(logits[top]) - double(logits[second])};
}

// Every request starts from an empty cache: no window may see another's tokens.
bool decode(llama_context* ctx, llama_batch& batch, const std::vector<llama_token>& toks, int first_pos,
            bool all_logits) {
    batch.n_tokens = int(toks.size());
    for (size_t i = 0; i < toks.size(); ++i) {
        batch.token[i] = toks[i];
        batch.pos[i] = first_pos + int(i);
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = all_logits || i + 1 == toks.size();
    }
    return llama_decode(ctx, batch) == 0;
}

void print_list(const char* key, const std::vector<double>& xs, bool ints) {
    std::printf("\"%s\": [", key);
    for (size_t i = 0; i < xs.size(); ++i) {
        if (ints) std::printf(i ? ", %d" : "%d", int(xs[i]));
        else std::printf(i ? ", %.9g" : "%.9g", xs[i]);
    }
    std::printf("]");
}

bool score(llama_context* ctx, llama_batch& batch, const std::vector<llama_token>& toks, int n_vocab) {
    if (!decode(ctx, batch, toks, 0, true)) return false;
    std::vector<double> nll, top;
    double sum = 0.0;
    for (size_t i = 0; i + 1 < toks.size(); ++i) {
        const float* logits = llama_get_logits_ith(ctx, int(i));
        Dist d = dist(logits, n_vocab);
        nll.push_back(d.logz - double(logits[toks[i + 1]]));
        sum += nll.back();
        top.push_back(d.top);
    }
    std::printf("{");
    print_list("nll", nll, false);
    std::printf(", \"sum\": %.12g, \"n\": %zu, ", sum, nll.size());
    print_list("top", top, true);
    std::printf("}\n");
    return true;
}

bool greedy(llama_context* ctx, llama_batch& batch, std::vector<llama_token> toks, int k, int n_vocab) {
    std::vector<double> out, margins;
    int pos = 0;
    while (int(out.size()) < k) {
        if (!decode(ctx, batch, toks, pos, false)) return false;
        pos += int(toks.size());
        Dist d = dist(llama_get_logits_ith(ctx, -1), n_vocab);
        out.push_back(d.top);
        margins.push_back(d.margin);
        toks.assign(1, d.top);
    }
    std::printf("{");
    print_list("greedy", out, true);
    std::printf(", ");
    print_list("margins", margins, false);
    std::printf("}\n");
    return true;
}

void quiet(ggml_log_level level, const char* text, void*) {
    if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf --ctx N [--threads T]\n", argv[0]);
        return 2;
    }
    int n_ctx = 512, threads = 1;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!std::strcmp(argv[i], "--ctx")) n_ctx = std::atoi(argv[i + 1]);
        else if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model* model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        std::fprintf(stderr, "llama.cpp could not load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    // one batch holds a whole window, so every position's logits come from one decode
    cp.n_ctx = cp.n_batch = cp.n_ubatch = uint32_t(n_ctx);
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = threads;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        std::fprintf(stderr, "llama.cpp could not make a context of %d tokens\n", n_ctx);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch batch = llama_batch_init(n_ctx, 0, 1);
    std::string line;
    int status = 0;
    while (status == 0 && std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string kind;
        int k = 0;
        in >> kind;
        if (kind == "greedy") in >> k;
        std::vector<llama_token> toks;
        for (long t; in >> t;) toks.push_back(llama_token(t));
        bool bad_id = false;
        for (llama_token t : toks) bad_id = bad_id || t < 0 || t >= n_vocab;
        if (toks.empty() || bad_id || int(toks.size()) + k > n_ctx || (kind != "score" && kind != "greedy")) {
            std::fprintf(stderr, "bad request (kind '%s', %zu tokens, context %d, vocabulary %d)\n", kind.c_str(),
                         toks.size(), n_ctx, n_vocab);
            status = 2;
            break;
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        bool ok = kind == "score" ? score(ctx, batch, toks, n_vocab) : greedy(ctx, batch, toks, k, n_vocab);
        if (!ok) {
            std::fprintf(stderr, "llama_decode failed\n");
            status = 1;
        }
        std::fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return status;
}

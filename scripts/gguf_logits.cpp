// Prints llama.cpp's logits for a token-id prompt: logits MODEL OUT.bin ID ID ...
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char ** argv) {
    if (argc < 4) { fprintf(stderr, "usage: logits MODEL OUT IDS...\n"); return 1; }
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    std::vector<llama_token> ids;
    for (int i = 3; i < argc; i++) ids.push_back(atoi(argv[i]));
    auto cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 256; cp.n_ubatch = 256; cp.n_threads = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch batch = llama_batch_init(ids.size(), 0, 1);
    for (size_t i = 0; i < ids.size(); i++) {
        batch.token[i] = ids[i]; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1;
    }
    batch.n_tokens = ids.size();
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * f = fopen(argv[2], "wb");
    for (size_t i = 0; i < ids.size(); i++) fwrite(llama_get_logits_ith(ctx, i), 4, n_vocab, f);
    fclose(f);
    printf("%zu x %d\n", ids.size(), n_vocab);
    return 0;
}

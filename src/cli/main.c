/* lunar: command-line entry. Each subcommand lives in its own file (cmd_*.c). */
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: lunar <command> [options]\n"
            "commands:\n"
            "  info MODEL_DIR                       architecture, parameter counts, bytes by dtype\n"
            "  logits MODEL_DIR --ids 1,2,3 --out F.npy   teacher-forced fp32 logits\n"
            "  generate MODEL_DIR --ids ... --max-tokens N [--temperature T --top-p P --top-k K --seed S]\n"
            "  tokenize MODEL_DIR --text-file F [--special]   token ids, one line\n"
            "  detokenize MODEL_DIR --ids 1,2,3      text\n"
            "  render MODEL_DIR --request REQ.json   chat request -> prompt text, ids, prompt_tokens\n"
            "  plan --config CONFIG.json [--tp N --draft F ...]   memory plan per GPU (plan --help)\n"
            "  serve MODEL_DIR [--port P --api-key K ...]   OpenAI-compatible HTTP server (docs/api.md)\n"
            "  bench MODEL [--load-format dummy ...]   offline prefill/decode throughput vs the floors (bench --help)\n"
            "  bench serve --base-url URL ...        drive a running server as vllm bench serve (bench serve --help)\n"
            "  bench-comm --tensor-parallel-size N [--nnodes K --node-rank I --master-addr A --master-port P]\n"
            "                                       NCCL all-reduce latency/bandwidth, one process per GPU\n"
            "common options: --backend cpu|cuda|auto; --load-format dummy (MODEL_DIR may then be a config.json)\n"
            "parallel (logits, generate, serve; CPU: rank threads): --tensor-parallel-size N\n"
            "  [--decode-context-parallel-size D] [--enable-expert-parallel]   (docs/parallel.md)\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (const lunar_command *c = lunar_commands; c->name; c++)
        if (strcmp(argv[1], c->name) == 0) return c->run(argc - 1, argv + 1);
    fprintf(stderr, "lunar: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

// Command dockerfile-lint checks a Dockerfile without a Docker engine, with BuildKit's own
// parser: syntax, instruction flags and arguments, and the build checks that run while
// parsing (FromAsCasing, StageNameCasing, MaintainerDeprecated), each a failure. The checks
// that need the base images (`docker build --check`) are not run. It then checks what this
// repository's image promises:
// every `COPY --from` names an earlier stage, every `${VAR}` in a FROM is a declared
// ARG, and the final stage runs as a numeric non-root USER with an ENTRYPOINT (its own or
// inherited from the earlier stage it is built FROM).
package main

import (
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/linter"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: dockerfile-lint Dockerfile")
		os.Exit(2)
	}
	problems, err := lint(os.Args[1])
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
	for _, p := range problems {
		fmt.Fprintf(os.Stderr, "%s: %s\n", os.Args[1], p)
	}
	if len(problems) > 0 {
		os.Exit(1)
	}
	fmt.Printf("%s: valid\n", os.Args[1])
}

func lint(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	res, err := parser.Parse(f)
	if err != nil {
		return nil, err
	}
	var problems []string
	for _, w := range res.Warnings {
		problems = append(problems, fmt.Sprintf("line %d: %s", w.Location.Start.Line, w.Short))
	}
	lint := linter.New(&linter.Config{Warn: func(rule, _, _, msg string, loc []parser.Range) {
		line := 0
		if len(loc) > 0 {
			line = loc[0].Start.Line
		}
		problems = append(problems, fmt.Sprintf("line %d: %s: %s", line, rule, msg))
	}})
	stages, metaArgs, err := instructions.Parse(res.AST, lint)
	if err != nil {
		return nil, err
	}
	if len(stages) == 0 {
		return nil, fmt.Errorf("no FROM")
	}
	declared := map[string]bool{}
	for _, a := range metaArgs {
		for _, kv := range a.Args {
			declared[kv.Key] = true
		}
	}
	ref := regexp.MustCompile(`\$\{?([A-Za-z_][A-Za-z0-9_]*)`)
	seen := map[string]bool{}
	for i, s := range stages {
		for _, m := range ref.FindAllStringSubmatch(s.BaseName, -1) {
			if !declared[m[1]] {
				problems = append(problems, fmt.Sprintf("stage %d: FROM uses ${%s}, which no ARG before the first FROM declares", i, m[1]))
			}
		}
		for _, c := range s.Commands {
			if cp, ok := c.(*instructions.CopyCommand); ok && cp.From != "" {
				if _, numeric := strconv.Atoi(cp.From); numeric != nil && !seen[strings.ToLower(cp.From)] && !strings.ContainsAny(cp.From, ":/") {
					problems = append(problems, fmt.Sprintf("stage %q: COPY --from=%s names no earlier stage", s.Name, cp.From))
				}
			}
		}
		if s.Name != "" {
			seen[strings.ToLower(s.Name)] = true
		}
	}
	// The final stage's USER and ENTRYPOINT may be inherited from the stage it is built FROM
	// (and so on): walk that chain from its root, so that the last setting wins, as in the
	// image.
	byName := map[string]int{}
	for i, s := range stages {
		if s.Name != "" {
			byName[strings.ToLower(s.Name)] = i
		}
	}
	chain := []int{len(stages) - 1}
	for {
		parent, ok := byName[strings.ToLower(stages[chain[0]].BaseName)]
		if !ok || parent >= chain[0] {
			break
		}
		chain = append([]int{parent}, chain...)
	}
	user, entrypoint := "", false
	for _, i := range chain {
		for _, c := range stages[i].Commands {
			switch c := c.(type) {
			case *instructions.UserCommand:
				user = c.User
			case *instructions.EntrypointCommand:
				entrypoint = true
			}
		}
	}
	uid := strings.SplitN(user, ":", 2)[0]
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		problems = append(problems, fmt.Sprintf("final stage: USER %q is not a numeric non-root uid", user))
	}
	if !entrypoint {
		problems = append(problems, "final stage: no ENTRYPOINT")
	}
	return problems, nil
}

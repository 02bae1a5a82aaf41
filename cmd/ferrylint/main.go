// Command ferrylint reports side effects inside Ferry agent tool bodies
// (see package ferrylint). Run it on its own, or as a vet tool:
//
//	go run github.com/ferry-dev/ferry/cmd/ferrylint ./...
//	go install github.com/ferry-dev/ferry/cmd/ferrylint
//	go vet -vettool=$(which ferrylint) ./...
package main

import (
	"golang.org/x/tools/go/analysis/singlechecker"

	"github.com/ferry-dev/ferry/ferrylint"
)

func main() { singlechecker.Main(ferrylint.Analyzer) }

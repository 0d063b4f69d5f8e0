import Storage
import Testing

/// The keys an index files a message under must hold every key of every query that finds
/// the message (`SearchNeedle`), or the index would hide it.
@Suite(.serialized) final class SearchTextTests {
    /// Every substring of each text (of one to six characters), in upper and lower case:
    /// where the needle finds it, the text's keys hold the query's.
    @Test func aQueryThatFindsATextHasOnlyKeysOfTheText() {
        let texts = ["Le café est prêt", "ΟΔΥΣΣΕΥΣ came home", "İstanbul'da", "party 🎉🎉 time 👍🏽", "Straße STRASSE", "ok", "日本語のテキスト"]
        var checked = 0
        for text in texts {
            let keys = Set(SearchText.keys(of: text, chat: 7))
            let characters = Array(text)
            for length in 1...6 {
                guard characters.count >= length else { continue }
                for start in 0...(characters.count - length) {
                    let piece = String(characters[start..<start + length])
                    for query in [piece, piece.uppercased(), piece.lowercased()] where SearchNeedle(query).isFound(in: text) {
                        #expect(Set(SearchText.queryKeys(query)).isSubset(of: keys), "\(query) in \(text)")
                        checked += 1
                    }
                }
            }
        }
        #expect(checked > 300)
    }

    @Test func keysOfCharactersRunsAndChatsAreApart() {
        let keys = SearchText.keys(of: "abcd", chat: 3)
        #expect((keys.filter { $0 >= 0 && $0 < 0x110000 }.sorted()) == ([0x61, 0x62, 0x63, 0x64]))
        #expect((keys.filter { $0 < 0 }.count) == 2)  // abc, bcd
        #expect((keys.filter { $0 >= 0x200000 }) == [SearchText.scope(3)])
        #expect(SearchText.scope(3) != SearchText.scope(4))
        #expect(SearchText.queryKeys("BC") == ([0x62, 0x63]))
        #expect(SearchText.queryKeys("abcd").count == 2)
        #expect(SearchText.queryKeys("abcdefg").count == 5)
        // A long query looks for runs spread over all of it, its first and last included.
        let long = "coffee deadline tomorrow"
        let runs = Set(SearchText.keys(of: long, chat: 1).filter { $0 < 0 })
        let asked = SearchText.queryKeys(long)
        #expect(asked.count == SearchText.maxQueryKeys)
        #expect(Set(asked).isSubset(of: runs))
        #expect(asked.contains(SearchText.keys(of: "cof", chat: 1).first { $0 < 0 }!))
        #expect(asked.contains(SearchText.keys(of: "row", chat: 1).first { $0 < 0 }!))
    }

    /// Past `maxKeys` a text is filed under its chat and `longKey` only (its keys would
    /// be most of a commit's memory), apart from every character's and chat's key.
    @Test func aTextWithTooManyKeysIsFiledAsLong() {
        var generator = SystemRandomNumberGenerator()
        let letters = Array("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?")
        let long = String((0..<20_000).map { _ in letters.randomElement(using: &generator)! })
        #expect(SearchText.keys(of: long, chat: 9) == ([SearchText.longKey, SearchText.scope(9)]))
        #expect(SearchText.keys(of: String(long.prefix(1000)), chat: 9).count <= (SearchText.maxKeys + 1))
        #expect(SearchText.longKey > 0x10FFFF)
        #expect(SearchText.longKey < SearchText.scope(0))
    }

    @Test func theNeedleIgnoresCaseCharacterByCharacter() {
        #expect(SearchNeedle("CAFÉ").isFound(in: "le café"))
        #expect(SearchNeedle("οδυσσευσ").isFound(in: "ΟΔΥΣΣΕΥΣ"))
        #expect(!SearchNeedle("cafe").isFound(in: "le café"))
        #expect(SearchNeedle("").isFound(in: "anything"))
    }
}
